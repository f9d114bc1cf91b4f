"""Incremental, UTF-8-safe detokenization.

Byte-level BPE splits one character across tokens (Chinese, emoji, flags, ZWJ sequences). Decoding each
token alone would publish U+FFFD halves. Instead the stream keeps the bytes of an incomplete UTF-8
sequence pending and publishes a character only once all its bytes arrived.

Invariant: for every split of a token sequence into steps, the concatenation of the step texts plus
``flush`` equals the whole-sequence decode (``bytes.decode("utf-8", "replace")``, which is what
``tokenizers``' ByteLevel decoder does). U+FFFD therefore appears only for bytes that are invalid
UTF-8 in the whole output, never for a character merely split across tokens.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

_Utf8Decoder = codecs.getincrementaldecoder("utf-8")


@dataclass(frozen=True)
class DetokenizerState:
    """The bytes of a UTF-8 sequence started but not completed (at most 3)."""

    pending: bytes = b""


class IncrementalDetokenizer:
    """Pure step functions over :class:`DetokenizerState`; holds only the read-only token-bytes table."""

    def __init__(self, token_bytes: Sequence[bytes]):
        self._token_bytes = token_bytes

    def bytes_of(self, token_id: int) -> bytes:
        # Ids outside the tokenizer's vocabulary (unused embedding rows) decode to nothing, like decode().
        return self._token_bytes[token_id] if 0 <= token_id < len(self._token_bytes) else b""

    def step(self, state: DetokenizerState, token_id: int) -> tuple[DetokenizerState, str]:
        return self.feed_bytes(state, self.bytes_of(token_id))

    @staticmethod
    def feed_bytes(state: DetokenizerState, data: bytes) -> tuple[DetokenizerState, str]:
        # CPython's incremental decoder applies the same maximal-subpart replacement as a one-shot
        # decode; restoring its buffer from the frozen state keeps this function pure.
        decoder = _Utf8Decoder("replace")
        decoder.setstate((state.pending, 0))
        text = decoder.decode(data)
        pending, _ = decoder.getstate()
        return DetokenizerState(pending), text

    @staticmethod
    def flush(state: DetokenizerState) -> str:
        """The text of bytes still pending when the output ends (U+FFFD: they never completed)."""
        return state.pending.decode("utf-8", "replace")
