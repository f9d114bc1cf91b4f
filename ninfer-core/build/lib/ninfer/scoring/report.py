"""The result of causal scoring: per-text scores, the token-weighted aggregate, the JSON report.

Invariants: ``nll`` is the total negative log-likelihood in nats, summed in float64 over exactly
``scored_tokens`` targets (every token after a text's first, see :mod:`.windows`);
``mean_nll = nll / scored_tokens`` and ``perplexity = exp(mean_nll)``. A text with no target (fewer
than 2 tokens) has ``scored_tokens == 0`` and ``mean_nll``/``perplexity`` None (JSON null). The
overall aggregate is token-weighted: the NLL and token counts of all texts summed, then divided, so
it is *not* the mean of the per-text perplexities. Floats are written unrounded (``repr`` precision).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ninfer.contracts.program import TokenLogprob

SCHEMA = "ninfer.score_report/1"


def _mean_and_ppl(nll: float, scored: int) -> tuple[float | None, float | None]:
    if scored == 0:
        return None, None
    mean = nll / scored
    # exp overflows past ~709.78 nats per token; such a model assigns its text probability 0 in fp64.
    return mean, (math.exp(mean) if mean < 709.0 else math.inf)


@dataclass(frozen=True)
class ScoreSettings:
    """How a run scored: window ``context`` and ``stride`` (tokens), activation dtype, device,
    the prefill chunk the windows were processed in, and what per-token detail was recorded."""

    context: int
    stride: int
    dtype: str
    device: str
    prefill_chunk_size: int
    logprobs: bool
    top_logprobs: int


class _NllTotals:
    """``mean_nll`` and ``perplexity`` (None when nothing was scored) of an object with ``nll`` and
    ``scored_tokens``."""

    nll: float
    scored_tokens: int

    @property
    def mean_nll(self) -> float | None:
        return _mean_and_ppl(self.nll, self.scored_tokens)[0]

    @property
    def perplexity(self) -> float | None:
        return _mean_and_ppl(self.nll, self.scored_tokens)[1]


@dataclass(frozen=True)
class TextScore(_NllTotals):
    """One text's score. ``token_logprobs`` (when requested): entry ``k`` is target ``x[k+1]``, so
    there are exactly ``scored_tokens`` entries, in text order."""

    index: int
    id: str | None
    input_tokens: int
    scored_tokens: int
    nll: float
    windows: int
    token_logprobs: tuple[TokenLogprob, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "id": self.id, "input_tokens": self.input_tokens,
                               "scored_tokens": self.scored_tokens, "windows": self.windows, "nll": self.nll,
                               "mean_nll": self.mean_nll, "perplexity": self.perplexity}
        if self.token_logprobs is not None:
            out["token_logprobs"] = [_token_dict(t) for t in self.token_logprobs]
        return out


def _token_dict(t: TokenLogprob) -> dict[str, Any]:
    out: dict[str, Any] = {"token": t.token, "logprob": t.logprob}
    if t.top:
        out["top"] = [[tok, lp] for tok, lp in t.top]
    return out


@dataclass(frozen=True)
class Aggregate(_NllTotals):
    """Token-weighted totals over several texts."""

    texts: int
    input_tokens: int
    scored_tokens: int
    nll: float

    def to_dict(self) -> dict[str, Any]:
        return {"texts": self.texts, "input_tokens": self.input_tokens, "scored_tokens": self.scored_tokens,
                "nll": self.nll, "mean_nll": self.mean_nll, "perplexity": self.perplexity}


@dataclass(frozen=True)
class ScoreReport:
    """A whole run: settings, the artifact's identity (``artifact_id``, ``name``, ``architecture``;
    None for an engine not built from an artifact), per-text results in input order, and timing
    (``processed_tokens`` counts every input token the model read, re-read context included)."""

    settings: ScoreSettings
    artifact: Mapping[str, Any]
    texts: tuple[TextScore, ...]
    elapsed_s: float
    processed_tokens: int

    @property
    def overall(self) -> Aggregate:
        return Aggregate(texts=len(self.texts), input_tokens=sum(t.input_tokens for t in self.texts),
                         scored_tokens=sum(t.scored_tokens for t in self.texts),
                         nll=math.fsum(t.nll for t in self.texts))

    def to_dict(self) -> dict[str, Any]:
        s = self.settings
        return {
            "schema": SCHEMA,
            "settings": {"context": s.context, "stride": s.stride, "dtype": s.dtype, "device": s.device,
                         "prefill_chunk_size": s.prefill_chunk_size, "logprobs": s.logprobs,
                         "top_logprobs": s.top_logprobs},
            "artifact": {k: self.artifact.get(k) for k in ("artifact_id", "name", "architecture")},
            "overall": self.overall.to_dict(),
            "timing": {"elapsed_s": self.elapsed_s, "processed_tokens": self.processed_tokens,
                       "processed_tokens_per_s": (self.processed_tokens / self.elapsed_s
                                                  if self.elapsed_s > 0 else None)},
            "texts": [t.to_dict() for t in self.texts],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)
