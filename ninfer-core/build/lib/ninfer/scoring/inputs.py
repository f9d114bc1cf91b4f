"""What causal scoring accepts: texts or token lists, normalised to :class:`ScoreInput`.

Accepted by :func:`normalize_inputs`: one text (``str``), one token list (a non-empty sequence of
ints), one :class:`ScoreInput`, or a non-empty sequence whose items are any of those. ``bytes`` are
refused (decode them first: scoring never guesses an encoding). Texts are tokenized as-is by the
model's tokenizer, with no special tokens added, so ``x[0]`` is the text's first token and is never
scored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ninfer.errors import NInferError


class InvalidScoringInput(NInferError):
    """An input cannot be scored as given (wrong type, bad token id, text that is not valid Unicode)."""


@dataclass(frozen=True)
class ScoreInput:
    """One text to score: exactly one of ``text`` and ``token_ids``; ``id`` only labels the report."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    id: str | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.token_ids is None):
            raise InvalidScoringInput("a ScoreInput needs exactly one of text and token_ids")
        if self.text is not None and not isinstance(self.text, str):
            raise InvalidScoringInput(f"ScoreInput.text must be a str, got {type(self.text).__name__}")
        if self.token_ids is not None:
            object.__setattr__(self, "token_ids", _token_tuple(self.token_ids, self.id))


def _token_tuple(tokens, label) -> tuple[int, ...]:
    if isinstance(tokens, (str, bytes, bytearray)) or not isinstance(tokens, Sequence):
        raise InvalidScoringInput(f"token_ids of input {label!r} must be a sequence of ints")
    bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int)]
    if bad:
        raise InvalidScoringInput(f"token_ids of input {label!r} hold non-integers, e.g. {bad[0]!r}")
    return tuple(int(t) for t in tokens)


def _is_token_list(value) -> bool:
    return (isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)) and len(value) > 0
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def _one(item, index: int) -> ScoreInput:
    if isinstance(item, ScoreInput):
        return item
    if isinstance(item, str):
        return ScoreInput(text=item)
    if isinstance(item, (bytes, bytearray)):
        raise InvalidScoringInput(f"input {index} is bytes: decode it to str first (scoring never guesses an "
                                  f"encoding)")
    if isinstance(item, Sequence):
        return ScoreInput(token_ids=_token_tuple(item, index))
    raise InvalidScoringInput(f"input {index} is a {type(item).__name__}: expected a str, a token list or a "
                              f"ScoreInput")


def normalize_inputs(inputs) -> list[ScoreInput]:
    """The inputs as a list of :class:`ScoreInput` (see the module docstring)."""
    if isinstance(inputs, (str, ScoreInput, bytes, bytearray)) or _is_token_list(inputs):
        return [_one(inputs, 0)]
    if not isinstance(inputs, Sequence):
        raise InvalidScoringInput(f"inputs is a {type(inputs).__name__}: expected a str, a token list, a "
                                  f"ScoreInput or a sequence of them")
    if len(inputs) == 0:
        raise InvalidScoringInput("nothing to score: inputs is empty")
    return [_one(item, i) for i, item in enumerate(inputs)]


def tokenize(item: ScoreInput, frontend, vocab_size: int, index: int) -> list[int]:
    """The token ids of ``item``: its own (checked against the vocabulary) or its text's, encoded
    with no special tokens added. A text that is not valid Unicode (lone surrogates) is refused."""
    label = item.id if item.id is not None else index
    if item.token_ids is not None:
        bad = [t for t in item.token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidScoringInput(f"input {label!r}: token ids {bad[:5]} are outside the vocabulary "
                                      f"[0, {vocab_size})")
        return list(item.token_ids)
    try:
        item.text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidScoringInput(f"input {label!r} is not valid Unicode text: {exc}") from None
    return list(frontend.encode(item.text))
