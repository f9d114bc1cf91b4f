"""Token log-probabilities in the OpenAI shapes (Chat ``logprobs.content`` and legacy Completions).

A token's text is its own bytes decoded alone (UTF-8 with replacement: a token holding part of a
character shows U+FFFD), and ``bytes`` gives the exact bytes so a client can rebuild split
characters, as the OpenAI API does.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from ninfer.contracts.program import TokenLogprob

from ninfer_serve.openai_models import ChoiceLogprobs, CompletionLogprobs, TokenLogprobEntry, TopLogprob


class TokenText:
    def __init__(self, frontend: Any) -> None:
        table = getattr(getattr(frontend, "tokenizer", None), "token_bytes", None)
        self._table: Sequence[bytes] | None = table
        self._frontend = frontend
        self.bytes_of = lru_cache(maxsize=65536)(self._bytes_of)

    def _bytes_of(self, token: int) -> bytes:
        if self._table is not None:
            return self._table[token] if 0 <= token < len(self._table) else b""
        return self._frontend.decode([token]).encode("utf-8")

    def text(self, token: int) -> str:
        return self.bytes_of(token).decode("utf-8", "replace")


def _finite(value: float) -> float:
    # JSON has no -inf: a token the filters excluded (probability 0) is reported at float's lowest.
    return value if value > -1e300 else -9999.0


def chat_logprobs(entries: Sequence[TokenLogprob], tokens: TokenText, top: int) -> ChoiceLogprobs:
    out = []
    for e in entries:
        b = tokens.bytes_of(e.token)
        alts = [TopLogprob(token=tokens.text(t), logprob=_finite(lp), bytes=list(tokens.bytes_of(t)))
                for t, lp in e.top[:top]]
        out.append(TokenLogprobEntry(token=tokens.text(e.token), logprob=_finite(e.logprob), bytes=list(b),
                                     top_logprobs=alts))
    return ChoiceLogprobs(content=out)


def completion_logprobs(entries: Sequence[TokenLogprob], tokens: TokenText, top: int,
                        start_offset: int = 0) -> CompletionLogprobs:
    texts, lps, tops, offsets = [], [], [], []
    offset = start_offset
    for e in entries:
        text = tokens.text(e.token)
        texts.append(text)
        lps.append(_finite(e.logprob))
        alts: dict[str, float] = {}
        for t, lp in e.top[:top]:
            alts.setdefault(tokens.text(t), _finite(lp))
        tops.append(alts if top else None)
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(tokens=texts, token_logprobs=lps, top_logprobs=tops, text_offset=offsets)
