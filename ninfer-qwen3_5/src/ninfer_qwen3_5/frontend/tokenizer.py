"""The Qwen byte-level BPE tokenizer, loaded from ``tokenizer.json`` bytes with HF ``tokenizers``.

Invariants:
- ``encode`` never adds special tokens (Qwen has no BOS); special-token text written in the input
  (``<|im_start|>``...) is recognized as the special token, which is how rendered chat prompts encode.
- ``decode`` keeps special tokens' text, so decoding is lossless for the frontend's parsers.
- ``token_bytes[i]`` are the exact bytes token ``i`` contributes to a decode: for every id sequence,
  ``b"".join(token_bytes[i] ...).decode("utf-8", "replace") == decode(ids)``. Ids the tokenizer does not
  know (embedding rows past the vocabulary) contribute no bytes, as in ``decode``.
- ``special_token_ids`` are the added tokens marked ``special`` (control tokens such as
  ``<|im_end|>``): constrained decoding never lets a grammar spell text with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from ninfer.contracts.errors import InvalidRequestError
from tokenizers import Tokenizer, decoders

from ninfer_qwen3_5.frontend.errors import FrontendError


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """The GPT-2 byte-level alphabet, char -> byte: printable bytes stand for themselves, the others are
    shifted to code points 256+ in byte order (the mapping ``tokenizers``' ByteLevel uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


class QwenTokenizer:
    """Immutable after construction; safe to share between threads and requests."""

    def __init__(self, tokenizer_json: bytes | str):
        try:
            text = tokenizer_json.decode("utf-8") if isinstance(tokenizer_json, bytes) else tokenizer_json
        except UnicodeDecodeError as exc:
            raise FrontendError(f"tokenizer.json: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
        try:
            self._tok = Tokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
            raise FrontendError(f"tokenizer.json: cannot be loaded ({exc})") from exc
        # Incremental detokenization works on raw bytes, which is only sound for a byte-level decoder.
        if not isinstance(self._tok.decoder, decoders.ByteLevel):
            raise FrontendError(
                f"tokenizer.json: decoder is {type(self._tok.decoder).__name__}, the Qwen frontend needs ByteLevel")
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.token_bytes: tuple[bytes, ...] = self._build_token_bytes()
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def _build_token_bytes(self) -> tuple[bytes, ...]:
        table = [b""] * self.vocab_size
        alphabet = _byte_level_alphabet()
        added = self._tok.get_added_tokens_decoder()
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if i in added:
                table[i] = added[i].content.encode("utf-8")
                continue
            try:
                table[i] = bytes(alphabet[c] for c in token)
            except KeyError as exc:
                raise FrontendError(f"tokenizer.json: token {i} {token!r} is not byte-level encoded") from exc
        return tuple(table)

    def encode(self, text: str) -> list[int]:
        if not text.isascii():
            _check_unicode(text)
        if len(text) > _LONG_TEXT:
            # Same ids; encode_batch releases the GIL while it works, encode holds it: a multi-MB prompt tokenised on
            # the server's worker thread would freeze every other request, /health included, until it finished.
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        known = [int(i) for i in token_ids if 0 <= int(i) < self.vocab_size]
        return self._tok.decode(known, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


# Characters above which encode goes through encode_batch (its per-call overhead is noise past this size).
_LONG_TEXT = 1 << 14


def _check_unicode(text: str) -> None:
    """A Python str may hold lone UTF-16 surrogates (JSON's "\\ud800" decodes to one); they are not Unicode text
    and the tokenizer cannot take them: a request-level error naming the first one."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"the text has a lone UTF-16 surrogate U+{ord(text[exc.start]):04X} at character "
                                  f"{exc.start}: it is not valid Unicode") from None
