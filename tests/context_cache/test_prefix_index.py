"""PrefixIndex: exact prefixes only, longest first, whatever the hash chain says."""

from __future__ import annotations

import random

import pytest
from ninfer.engine.context_cache.prefix_index import PrefixIndex, PrefixIndexError


def test_longest_exact_prefix_first():
    idx = PrefixIndex(4)
    base = list(range(20))
    idx.insert(1, base[:3])
    idx.insert(2, base[:8])
    idx.insert(3, base[:11])
    idx.insert(4, base[:8] + [99, 98, 97])    # diverges after 8
    assert idx.prefixes_of(base, limit=19) == [(11, 3), (8, 2), (3, 1)]
    assert idx.prefixes_of(base, limit=10) == [(8, 2), (3, 1)]
    assert idx.prefixes_of(base[:11], limit=10) == [(8, 2), (3, 1)]  # never the whole prompt itself
    assert idx.prefixes_of([5] + base[1:], limit=19) == []
    assert idx.find(base[:8]) == 2 and idx.find(base[:9]) is None
    with pytest.raises(PrefixIndexError):
        idx.insert(5, base[:8])
    idx.remove(2)
    assert idx.prefixes_of(base, limit=19) == [(11, 3), (3, 1)]
    with pytest.raises(PrefixIndexError):
        idx.remove(2)


def test_collisions_never_return_a_wrong_prefix(monkeypatch):
    idx = PrefixIndex(2)
    monkeypatch.setattr(idx, "_chain", lambda key, block: 7)  # every chain key collides
    idx.insert(1, [1, 2, 3])
    idx.insert(2, [4, 5, 6, 7])
    assert idx.prefixes_of([1, 2, 3, 9], limit=3) == [(3, 1)]
    assert idx.prefixes_of([4, 5, 6, 7, 0], limit=4) == [(4, 2)]
    assert idx.prefixes_of([4, 5, 3, 9], limit=3) == []        # same tail [3] after a different block
    assert idx.prefixes_of([9, 9, 6, 7, 0], limit=4) == []


def test_random_against_brute_force():
    rng = random.Random(3)
    idx = PrefixIndex(3)
    stored: dict[int, tuple[int, ...]] = {}
    for eid in range(200):
        base = rng.choice(list(stored.values())) if stored and rng.random() < 0.7 else ()
        toks = tuple(base[: rng.randint(0, len(base))]) + tuple(rng.randrange(3) for _ in range(rng.randint(1, 6)))
        if toks in stored.values():
            continue
        idx.insert(eid, toks)
        stored[eid] = toks
        if rng.random() < 0.1:
            gone = rng.choice(list(stored))
            idx.remove(gone)
            del stored[gone]
    for _ in range(300):
        prompt = tuple(rng.randrange(3) for _ in range(rng.randint(1, 30)))
        limit = rng.randint(0, len(prompt))
        want = sorted(((len(t), e) for e, t in stored.items() if len(t) <= limit and prompt[: len(t)] == t),
                      key=lambda x: -x[0])
        assert sorted(idx.prefixes_of(prompt, limit)) == sorted(want)
        got = idx.prefixes_of(prompt, limit)
        assert [n for n, _ in got] == sorted((n for n, _ in got), reverse=True)
