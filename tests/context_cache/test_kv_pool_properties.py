"""Property tests of the paged KV storage (``ninfer.storage.kv_pool``) against a plain model of what every owner
and prefix ref must read.

Random sequences of the operations the engine and the context cache perform (extend a history, write into it,
release it, share a prefix, adopt one, release one, move a prefix's pages to a Host copy and back) on a tiny pool,
checking after every step the invariants the module states:

- reference counts: a page's count is the number of histories and prefix refs listing it; a page is free exactly
  when its count is 0; the free list holds no page twice;
- copy-on-write isolation: what each history and each prefix ref reads is exactly what was written for it,
  whatever other histories wrote since (a page shared by several is never written in place);
- atomicity: an ``ensure`` or ``attach_pages`` that cannot get its pages changes nothing;
- a prefix ref with Host entries is never adopted.

The allocator alone is checked against a multiset model as well (double frees and over-allocation refused,
nothing changed by a refused call).
"""

from __future__ import annotations

from collections import Counter

import pytest

hypothesis = pytest.importorskip("hypothesis")
import torch  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)
from ninfer.storage.kv_pool import ON_HOST, KVPoolError, PageAllocator, PagedKVCache  # noqa: E402

# -- the allocator alone ------------------------------------------------------------------------------------

ALLOC_OPS = st.lists(st.tuples(st.sampled_from(["allocate", "retain", "free"]), st.integers(0, 6),
                               st.lists(st.integers(0, 40), max_size=4)), max_size=40)


@given(num_pages=st.integers(1, 8), ops=ALLOC_OPS)
def test_page_allocator_matches_a_multiset_model(num_pages, ops):
    alloc = PageAllocator(num_pages)
    refs: Counter[int] = Counter()  # the model: references held per page
    for kind, n, picks in ops:
        held = sorted(refs)
        before = (alloc.free_pages, {p: alloc.refcount(p) for p in range(num_pages)})
        if kind == "allocate":
            pages = alloc.allocate(n)
            if n > num_pages - len(refs):
                assert pages is None  # refused whole, nothing taken
            else:
                assert pages is not None and len(pages) == len(set(pages)) == n
                assert not set(pages) & set(refs) and all(0 <= p < num_pages for p in pages)
                refs.update(pages)
        else:
            # Mostly held pages (what the engine does), sometimes any id (a bug the allocator must refuse).
            chosen = [held[i % len(held)] if held and i % 3 else i for i in picks]
            want = Counter(chosen)
            legal = all(p in refs for p in want) if kind == "retain" else all(want[p] <= refs[p] for p in want)
            if legal:
                getattr(alloc, kind)(chosen)
                if kind == "retain":
                    refs.update(chosen)
                else:
                    refs.subtract(chosen)
                    refs = +refs  # drop pages whose count reached 0
            else:
                with pytest.raises(KVPoolError):
                    getattr(alloc, kind)(chosen)
                assert (alloc.free_pages, {p: alloc.refcount(p) for p in range(num_pages)}) == before
        assert {p: alloc.refcount(p) for p in range(num_pages) if alloc.refcount(p)} == dict(refs)
        assert alloc.free_pages == num_pages - len(refs)
        assert sorted(alloc._free) == sorted(set(range(num_pages)) - set(refs))  # each free page once


# -- the paged cache: histories, prefix refs, the Host tier --------------------------------------------------


class KVPoolMachine(RuleBasedStateMachine):
    """Model: each owner's written token values; each live prefix ref's values (and the Host copy of its detached
    pages). Values are unique per write, so any page aliasing shows up as a wrong value read back."""

    refs = Bundle("refs")

    @initialize(num_pages=st.integers(2, 10), page_size=st.integers(1, 4))
    def setup(self, num_pages, page_size):
        self.cache = PagedKVCache([0], num_pages=num_pages, page_size=page_size, num_kv_heads=1, head_dim=1,
                                  dtype=torch.float64, device=torch.device("cpu"))
        self.values: dict[int, list[float]] = {}      # owner -> the values of its tokens, in order
        self.ref_values: dict[int, list[float]] = {}  # ref_id -> the values of its tokens
        self.host: dict[int, dict[int, tuple]] = {}   # ref_id -> page index -> (K, V) copy of a detached page
        self.live: dict[int, object] = {}             # ref_id -> the live KVPrefixRef
        self.next_value = 1.0

    # -- reading ---------------------------------------------------------------------------------------------
    def _read(self, pages, n: int) -> list[float]:
        k, _ = self.cache.pools(0)
        ps = self.cache.page_size
        return [float(k[pages[t // ps], t % ps, 0, 0]) for t in range(n)]

    def _state(self):
        c = self.cache
        return ({o: c.table(o) for o in range(4)}, c.allocator.free_pages, c.num_prefixes,
                {p: c.allocator.refcount(p) for p in range(c.num_pages)})

    # -- histories -------------------------------------------------------------------------------------------
    @rule(owner=st.integers(0, 3), extra=st.integers(0, 6), back=st.integers(0, 5))
    def write(self, owner, extra, back):
        """Extend ``owner`` to ``len + extra`` tokens and (re)write its last ``back + extra`` of them."""
        old = self.values.get(owner, [])
        n = len(old) + extra
        start = max(0, len(old) - back)
        if n == 0:
            return
        before = self._state()
        if not self.cache.ensure(owner, n, write_from=start):
            assert self._state() == before  # atomic: nothing changed
            return
        assert self.cache.capacity(owner) >= n and self.cache.writable(owner, start, n)
        slots = self.cache.slot_mapping(owner, start, n)
        k, v = self.cache.pools(0)
        new = []
        for slot in slots:
            k.view(-1)[slot] = self.next_value
            v.view(-1)[slot] = -self.next_value
            new.append(self.next_value)
            self.next_value += 1
        self.values[owner] = (old + [0.0] * extra)[:start] + new

    @rule(owner=st.integers(0, 3))
    def release(self, owner):
        self.cache.release(owner)
        self.values.pop(owner, None)

    # -- prefix refs -----------------------------------------------------------------------------------------
    @precondition(lambda self: any(self.values.values()))
    @rule(target=refs, pick=st.integers(0, 3), fraction=st.floats(0.0, 1.0))
    def share(self, pick, fraction):
        owners = sorted(o for o, vals in self.values.items() if vals)
        owner = owners[pick % len(owners)]
        n = max(1, round(fraction * len(self.values[owner])))
        ref = self.cache.share_prefix(owner, n)
        self.live[ref.ref_id] = ref
        self.ref_values[ref.ref_id] = self.values[owner][:n]
        self.host[ref.ref_id] = {}
        return ref.ref_id

    @rule(ref_id=consumes(refs))
    def release_ref(self, ref_id):
        self.cache.release_prefix(self.live.pop(ref_id))
        del self.ref_values[ref_id], self.host[ref_id]

    @rule(ref_id=refs, owner=st.integers(0, 3))
    def adopt(self, ref_id, owner):
        ref = self.live[ref_id]
        if owner in self.values or self.cache.table(owner):
            with pytest.raises(KVPoolError, match="already has a KV history"):
                self.cache.adopt_prefix(owner, ref)
            return
        if ON_HOST in ref.pages:
            with pytest.raises(KVPoolError, match="restore them before adopting"):
                self.cache.adopt_prefix(owner, ref)
            return
        self.cache.adopt_prefix(owner, ref)
        self.values[owner] = list(self.ref_values[ref_id])

    @rule(ref_id=refs, mask=st.integers(0, 255))
    def detach(self, ref_id, mask):
        """Move some device pages of a ref to a Host copy (the caller copies them out first)."""
        ref = self.live[ref_id]
        indices = [i for i, p in enumerate(ref.pages) if p != ON_HOST and mask >> i & 1]
        if not indices:
            return
        copies = self.cache.read_pages([ref.pages[i] for i in indices])[0]
        new = self.cache.detach_pages(ref, indices)
        assert new.ref_id != ref.ref_id and new.num_tokens == ref.num_tokens
        assert all(new.pages[i] == ON_HOST for i in indices)
        for j, i in enumerate(indices):
            self.host[ref_id][i] = (copies[0][j].clone(), copies[1][j].clone())
        self.live[ref_id] = new

    @rule(ref_id=refs)
    def attach(self, ref_id):
        ref = self.live[ref_id]
        if not ref.host_indices:
            return
        before = self._state()
        got = self.cache.attach_pages(ref)
        if got is None:
            assert len(ref.host_indices) > before[1] and self._state() == before  # too few free: no change
            return
        new, fresh = got
        held = self.host[ref_id]
        k = torch.stack([held[i][0] for i in ref.host_indices])
        v = torch.stack([held[i][1] for i in ref.host_indices])
        self.cache.write_pages(fresh, [(k, v)])
        assert ON_HOST not in new.pages and [new.pages[i] for i in ref.host_indices] == list(fresh)
        self.host[ref_id] = {}
        self.live[ref_id] = new

    # -- invariants ------------------------------------------------------------------------------------------
    @invariant()
    def reference_counts(self):
        if not hasattr(self, "cache"):
            return
        c = self.cache
        listed: Counter[int] = Counter()
        for owner in range(4):
            table = c.table(owner)
            assert len(table) == len(set(table))
            listed.update(table)
        for ref in self.live.values():
            listed.update(ref.device_pages)
        assert c.num_prefixes == len(self.live)
        for p in range(c.num_pages):
            assert c.allocator.refcount(p) == listed[p], p
        assert sorted(c.allocator._free) == sorted(set(range(c.num_pages)) - set(listed))
        in_tables = {p for owner in range(4) for p in c.table(owner)}
        only_refs = {p for ref in self.live.values() for p in ref.device_pages} - in_tables
        assert c.pages_only_in_prefixes() == len(only_refs)

    @invariant()
    def everyone_reads_what_was_written_for_it(self):
        if not hasattr(self, "cache"):
            return
        for owner, vals in self.values.items():
            assert self._read(self.cache.table(owner), len(vals)) == vals, owner
        for ref_id, ref in self.live.items():
            ps = self.cache.page_size
            want = self.ref_values[ref_id]
            for t, value in enumerate(want):
                i = t // ps
                if ref.pages[i] == ON_HOST:
                    got = float(self.host[ref_id][i][0][t % ps, 0, 0])
                else:
                    got = self._read(ref.pages, t + 1)[t]
                assert got == value, (ref_id, t)


KVPoolMachine.TestCase.settings = hypothesis.settings(hypothesis.settings(), stateful_step_count=30)
test_kv_pool_state_machine = KVPoolMachine.TestCase
