"""Property tests of the context cache's PrefixIndex against a brute-force model.

Random inserts, removals and lookups over a 3-token alphabet (so entries share prefixes and block boundaries
often), with the block size drawn too. The module's invariants, checked after every step:

- ``prefixes_of(tokens, limit)`` is exactly the indexed entries that are a prefix of ``tokens``, of 1 to ``limit``
  tokens, longest first; ``find`` is exactly the entry holding those tokens;
- one entry id per distinct token sequence: inserting a duplicate (by id or by tokens) is refused and changes
  nothing.

A second machine forces chain-key collisions (every block hashes to one of two keys): an entry whose slot is taken
by different tokens is left out (the older one stays), and lookups still never return anything but exact prefixes.
"""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402
from ninfer.engine.context_cache.prefix_index import PrefixIndex, PrefixIndexError  # noqa: E402

TOKENS = st.lists(st.integers(0, 2), max_size=10)


class PrefixIndexMachine(RuleBasedStateMachine):
    collide = False

    @initialize(block_size=st.integers(1, 4))
    def setup(self, block_size):
        self.index = PrefixIndex(block_size)
        if self.collide:
            self.index._chain = lambda key, block: hash((key, block)) % 2  # many different chains share a key
        self.entries: dict[int, tuple[int, ...]] = {}  # the model: what is indexed
        self.next_id = 0
        self.probes: list[tuple[int, ...]] = [()]

    @rule(tokens=TOKENS)
    def insert(self, tokens):
        toks = tuple(tokens)
        eid, self.next_id = self.next_id, self.next_id + 1
        self.probes.append(toks)
        if toks in self.entries.values():
            with pytest.raises(PrefixIndexError, match="duplicates entry"):
                self.index.insert(eid, toks)
            assert eid not in self.index
            return
        self.index.insert(eid, toks)
        if self.collide and eid not in self.index:
            # Refused on a chain-key collision: only then, and only if another entry holds the slot.
            assert self.index.find(toks) is None
            return
        assert eid in self.index
        self.entries[eid] = toks

    @rule(pick=st.integers(0, 50))
    def reinsert_an_id(self, pick):
        if not self.entries:
            return
        eid = sorted(self.entries)[pick % len(self.entries)]
        with pytest.raises(PrefixIndexError, match="already indexed"):
            self.index.insert(eid, (9, 9, 9))

    @rule(pick=st.integers(0, 50))
    def remove(self, pick):
        if not self.entries:
            with pytest.raises(PrefixIndexError, match="not indexed"):
                self.index.remove(self.next_id + 1)
            return
        eid = sorted(self.entries)[pick % len(self.entries)]
        self.index.remove(eid)
        del self.entries[eid]
        assert eid not in self.index

    @rule(tokens=TOKENS, limit=st.integers(0, 12))
    def look_up(self, tokens, limit):
        self._check(tuple(tokens), limit)

    def _check(self, toks: tuple[int, ...], limit: int) -> None:
        want = sorted(((len(e), eid) for eid, e in self.entries.items()
                       if 1 <= len(e) <= min(limit, len(toks)) and toks[:len(e)] == e), reverse=True)
        assert self.index.prefixes_of(toks, limit) == want
        exact = [eid for eid, e in self.entries.items() if e == toks]
        assert self.index.find(toks) == (exact[0] if exact else None)

    @invariant()
    def every_entry_is_found_and_nothing_else(self):
        if not hasattr(self, "index"):
            return
        assert len(self.index) == len(self.entries)
        for toks in self.probes[-6:]:
            for extra in ((), (0,), (2, 1)):
                self._check(toks + extra, len(toks) + len(extra))


class CollidingPrefixIndexMachine(PrefixIndexMachine):
    collide = True


PrefixIndexMachine.TestCase.settings = hypothesis.settings(hypothesis.settings(), stateful_step_count=40)
CollidingPrefixIndexMachine.TestCase.settings = hypothesis.settings(hypothesis.settings(), stateful_step_count=40)
test_prefix_index_state_machine = PrefixIndexMachine.TestCase
test_prefix_index_under_collisions = CollidingPrefixIndexMachine.TestCase
