"""Per-request sampling parameters (validated at submit, immutable afterwards)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ninfer.contracts.field_types import normalize_fields, type_problem
from ninfer.errors import NInferError


class InvalidSamplingParams(NInferError):
    """A sampling parameter is out of range; the message names it."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling controls of one request.

    temperature 0 means greedy. ``seed`` None means the engine draws one at submit (so Replay
    reproduces the same tokens). top_k 0 = off, top_p 1.0 = off, min_p 0.0 = off. Penalties follow
    vLLM: repetition_penalty (1.0 = off) divides positive / multiplies negative logits of tokens seen
    in prompt or output; presence/frequency penalties subtract per output-token occurrence.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        normalize_fields(self)   # numpy scalars and lists become Python ints, floats and tuples

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        def bad(field: str, why: str) -> InvalidSamplingParams:
            return InvalidSamplingParams(f"invalid sampling parameter {field}={getattr(self, field)!r}: {why}")

        for f in fields(self):   # first: the range checks below and the worker assume these types
            why = type_problem(getattr(self, f.name), f.type)
            if why is not None:
                raise bad(f.name, why)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            if not math.isfinite(float(getattr(self, name))):
                raise bad(name, "must be finite")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", "must be >= 0 (0 disables)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens < 1:
            raise bad("max_tokens", "must be >= 1")
        if self.top_logprobs < 0 or self.top_logprobs > 20:
            raise bad("top_logprobs", "must be in [0, 20]")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise bad("seed", "must be in [0, 2**63)")
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    raise bad("stop_token_ids", f"token id {t} is outside the vocabulary [0, {vocab_size})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
