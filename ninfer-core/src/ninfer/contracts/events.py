"""What a request's consumer receives, in order, through its GenerationHandle.

Ordering invariants (enforced by the engine worker, the only producer):
- :class:`GenerationStart` comes at most once, after first admission and before any delta; it is
  never repeated when a preempted request resumes.
- :class:`GenerationDelta` carries only committed output (model state and OutputSession committed).
- Exactly one terminal event ends every stream: :class:`GenerationResult` or :class:`GenerationError`.
  A request rejected or cancelled before admission gets its terminal event without a start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ninfer.contracts.frontend import OutputDelta, OutputFinal
from ninfer.contracts.program import TokenLogprob
from ninfer.errors import NInferError

# "stop": a stop token or string; "length": max_tokens or max_context reached; "cancelled": the
# consumer cancelled or abandoned the handle; "deadline": the request's deadline passed after admission.
FinishReason = Literal["stop", "length", "cancelled", "deadline"]


@dataclass(frozen=True)
class Usage:
    """Token counts of one request. ``cached_tokens``: the prompt tokens its admission restored from a
    context-cache checkpoint instead of computing them (0 without a hit; at most ``prompt_tokens``)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class Timings:
    """Seconds, measured from submit. ``ttft_s`` is None when no token was produced."""

    queue_s: float | None
    ttft_s: float | None
    total_s: float


@dataclass(frozen=True)
class GenerationStart:
    request_id: str
    prompt_tokens: int


@dataclass(frozen=True)
class GenerationDelta:
    """Newly committed output: the accepted token ids, the text deltas they published, and their
    logprobs when the request asked for them (aligned with ``token_ids``)."""

    request_id: str
    token_ids: tuple[int, ...]
    deltas: tuple[OutputDelta, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class GenerationResult:
    """Terminal success (including cancellation). ``token_ids`` is the whole accepted output; ``output``
    is the OutputSession's final view (None when the session was never opened)."""

    request_id: str
    finish_reason: FinishReason
    token_ids: tuple[int, ...]
    output: OutputFinal | None
    usage: Usage
    timings: Timings
    stop_reason: str | int | None = None


@dataclass(frozen=True)
class GenerationError:
    """Terminal failure: a request-level rejection (``RequestRejected``/``InvalidSamplingParams``) or
    an ``EngineFailure``."""

    request_id: str
    error: NInferError


GenerationEvent = GenerationStart | GenerationDelta | GenerationResult | GenerationError
TERMINAL_EVENTS = (GenerationResult, GenerationError)
