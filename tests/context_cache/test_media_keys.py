"""The prefix index's keys of prompts with media (:func:`prefix_keys`): placeholder tokens stand as the digest of
their medium, so equal token runs of different media never match, the same medium does, and text before the first
medium matches whatever follows it."""

from __future__ import annotations

import torch
from ninfer.contracts.media import MediaInput
from ninfer.engine.context_cache.prefix_index import PrefixIndex, prefix_keys

PAD = 9


def medium(digest: str, *spans) -> MediaInput:
    """A video of one 2 x 2-patch frame per span (the keys read only the spans and the digest)."""
    return MediaInput("video", torch.zeros(4 * len(spans), 8), (len(spans), 2, 2), digest, PAD, tuple(spans))


TOKENS = (1, 2, PAD, PAD, 3, PAD, PAD, 4, 5)
A = medium("a", (2, 4), (5, 7))
B = medium("b", (2, 4), (5, 7))


def test_keys():
    assert prefix_keys(TOKENS) == TOKENS
    keys = prefix_keys(TOKENS, [A])
    assert keys[:2] == (1, 2) and keys[4] == 3 and keys[7:] == (4, 5)
    assert keys[2:4] == ((PAD, "a", 0), (PAD, "a", 1)) and keys[5:7] == ((PAD, "a", 2), (PAD, "a", 3))
    assert prefix_keys(TOKENS[:6], [A]) == keys[:6]                 # spans past the prefix are cut
    assert prefix_keys(TOKENS, [B]) != keys


def test_index_matches_only_the_same_media():
    idx = PrefixIndex(2)
    idx.insert(1, prefix_keys(TOKENS[:2], [A]))      # before the medium: text only
    idx.insert(2, prefix_keys(TOKENS[:6], [A]))      # inside its second span
    idx.insert(3, prefix_keys(TOKENS[:8], [A]))      # after it
    same = prefix_keys(TOKENS, [A])
    assert [eid for _, eid in idx.prefixes_of(same, len(same) - 1)] == [3, 2, 1]
    other = prefix_keys(TOKENS, [B])
    assert [eid for _, eid in idx.prefixes_of(other, len(other) - 1)] == [1]
    # The same tokens without media (placeholders typed as text) are another prompt too.
    assert [eid for _, eid in idx.prefixes_of(TOKENS, len(TOKENS) - 1)] == [1]
    assert idx.find(prefix_keys(TOKENS[:6], [A])) == 2 and idx.find(prefix_keys(TOKENS[:6], [B])) is None
