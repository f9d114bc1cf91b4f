"""PrefixIndex: find the cached token sequences that are exact prefixes of a new prompt.

Entries are key sequences: the tokens a checkpoint covers, as :func:`prefix_keys` makes them, where each
placeholder token of an image or video stands as ``(token, media digest, index in the medium)``, so that equal
token runs of different media never match (and the same medium, re-sent in a later turn, does). The index is a hash chain over
``block_size``-token blocks plus an exact tail: an entry of ``n`` tokens is filed under the chain key
of its first ``n // block_size`` full blocks and the tuple of its remaining ``n % block_size`` tokens.
A lookup walks the prompt's blocks once, so its cost is linear in the prompt, whatever the number of
entries sharing a block boundary.

Invariants:
- The chain key only narrows candidates (hash collisions are possible); :meth:`PrefixIndex.prefixes_of`
  returns an entry only after comparing its tokens with the prompt exactly.
- One entry id per distinct token sequence: :meth:`PrefixIndex.insert` refuses a duplicate.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from ninfer.contracts.media import MediaInput
from ninfer.errors import NInferError

_ROOT = 0


def prefix_keys(tokens: Sequence[int], media: Sequence[MediaInput] = ()) -> tuple[Hashable, ...]:
    """The index keys of ``tokens`` (a prefix of a prompt whose images and videos are ``media``): the token ids,
    except that the placeholder tokens of each medium's spans become ``(token, digest, k)`` with ``k`` counting the
    medium's placeholders (spans past ``tokens`` are cut). A medium's digest stands for its pixels and grid."""
    keys: list[Hashable] = [int(t) for t in tokens]
    n = len(keys)
    for m in media:
        k = 0
        for a, b in m.spans:
            for i in range(a, min(b, n)):
                keys[i] = (keys[i], m.digest, k)
                k += 1
    return tuple(keys)


class PrefixIndexError(NInferError):
    """An index operation broke its rules (duplicate entry, unknown entry)."""


class PrefixIndex:
    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise PrefixIndexError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._buckets: dict[int, dict[tuple[int, ...], int]] = {}
        self._entries: dict[int, tuple[Hashable, ...]] = {}
        self._keys: dict[int, tuple[int, tuple[Hashable, ...]]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _chain(self, key: int, block: tuple[Hashable, ...]) -> int:
        return hash((key, block))

    def _locate(self, tokens: tuple[Hashable, ...]) -> tuple[int, tuple[Hashable, ...]]:
        b = self.block_size
        full = len(tokens) // b
        key = _ROOT
        for j in range(full):
            key = self._chain(key, tokens[j * b:(j + 1) * b])
        return key, tokens[full * b:]

    def insert(self, entry_id: int, tokens: Sequence[Hashable]) -> None:
        toks = tuple(tokens)
        if entry_id in self._entries:
            raise PrefixIndexError(f"entry {entry_id} is already indexed")
        key, tail = self._locate(toks)
        bucket = self._buckets.setdefault(key, {})
        other = bucket.get(tail)
        if other is not None and self._entries[other] == toks:
            raise PrefixIndexError(f"entry {entry_id} duplicates entry {other}")
        if other is not None:  # a chain-key collision with different tokens: keep the older entry
            return
        bucket[tail] = entry_id
        self._entries[entry_id] = toks
        self._keys[entry_id] = (key, tail)

    def remove(self, entry_id: int) -> None:
        if entry_id not in self._entries:
            raise PrefixIndexError(f"entry {entry_id} is not indexed")
        key, tail = self._keys.pop(entry_id)
        del self._entries[entry_id]
        bucket = self._buckets[key]
        del bucket[tail]
        if not bucket:
            del self._buckets[key]

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._entries

    def find(self, tokens: Sequence[Hashable]) -> int | None:
        """The entry holding exactly ``tokens``, or None."""
        toks = tuple(tokens)
        key, tail = self._locate(toks)
        eid = self._buckets.get(key, {}).get(tail)
        return eid if eid is not None and self._entries[eid] == toks else None

    def prefixes_of(self, tokens: Sequence[Hashable], limit: int) -> list[tuple[int, int]]:
        """``(length, entry_id)`` of every entry that is an exact prefix of ``tokens`` no longer than
        ``limit`` tokens, longest first."""
        toks = tuple(tokens)
        b = self.block_size
        limit = min(limit, len(toks))
        out: list[tuple[int, int]] = []
        key, start = _ROOT, 0
        while start <= limit:
            bucket = self._buckets.get(key)
            if bucket:
                for tail, eid in bucket.items():
                    n = start + len(tail)
                    if n <= limit and n >= 1 and self._entries[eid] == toks[:n]:
                        out.append((n, eid))
            if start + b > limit:
                break
            key = self._chain(key, toks[start:start + b])
            start += b
        out.sort(key=lambda x: -x[0])
        return out
