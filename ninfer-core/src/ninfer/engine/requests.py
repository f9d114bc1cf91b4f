"""RequestRecord: the worker's state of one request, and its lifecycle state machine.

Only the engine worker thread touches a record. Lifecycle (docs/design.md section 5, text-only subset):

    WAITING -> MATERIALIZING -> PREFILL -> DECODE_READY -> MODEL_FINISHED -> SETTLED
    resident (PREFILL | REPLAY | DECODE_READY) -> PAUSING -> PAUSED -> MATERIALIZING
    MATERIALIZING -> REPLAY (resume with output) | PREFILL (resume before the first token)
    any non-settled state -> SETTLED (cancellation, deadline, rejection, engine stop)

Invariants:
- ``seq`` is not None exactly in the resident states (PREFILL, REPLAY, DECODE_READY) and in
  MATERIALIZING/MODEL_FINISHED/PAUSING while the worker holds it.
- ``output_tokens`` holds only committed, published tokens; ``len(output_tokens)`` is also the
  sampling step counter (Replay does not sample, so it never advances the counter).
- ``started`` flips once, when GenerationStart is published; resume never publishes it again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ninfer.contracts.errors import EngineFailure
from ninfer.contracts.frontend import OutputSession
from ninfer.contracts.media import MediaInput
from ninfer.contracts.program import ResumeState, RowSampling, SeqId
from ninfer.contracts.sampling import SamplingParams
from ninfer.engine.handle import RequestControl


class RequestState(enum.Enum):
    WAITING = "waiting"
    MATERIALIZING = "materializing"
    PREFILL = "prefill"
    REPLAY = "replay"
    DECODE_READY = "decode_ready"
    MODEL_FINISHED = "model_finished"
    PAUSING = "pausing"
    PAUSED = "paused"
    SETTLED = "settled"


_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.WAITING: frozenset({RequestState.MATERIALIZING, RequestState.SETTLED}),
    RequestState.MATERIALIZING: frozenset({RequestState.PREFILL, RequestState.REPLAY, RequestState.WAITING,
                                           RequestState.PAUSED, RequestState.SETTLED}),
    RequestState.PREFILL: frozenset({RequestState.DECODE_READY, RequestState.MODEL_FINISHED, RequestState.PAUSING,
                                     RequestState.SETTLED}),
    RequestState.REPLAY: frozenset({RequestState.DECODE_READY, RequestState.PAUSING, RequestState.SETTLED}),
    RequestState.DECODE_READY: frozenset({RequestState.MODEL_FINISHED, RequestState.PAUSING, RequestState.SETTLED}),
    RequestState.MODEL_FINISHED: frozenset({RequestState.SETTLED}),
    RequestState.PAUSING: frozenset({RequestState.PAUSED}),
    RequestState.PAUSED: frozenset({RequestState.MATERIALIZING, RequestState.SETTLED}),
    RequestState.SETTLED: frozenset(),
}


@dataclass(eq=False)
class RequestRecord:
    """Mutable worker-side state of one request (see the module docstring for invariants)."""

    ticket: int                      # submission order: FIFO admission and "youngest" for preemption
    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams           # validated, seed filled in
    session: OutputSession
    control: RequestControl
    submit_time: float
    deadline: float | None
    state: RequestState = RequestState.WAITING
    seq: SeqId | None = None
    output_tokens: list[int] = field(default_factory=list)
    resume: ResumeState | None = None  # while PAUSED: a Snapshot (revocable) or Replay
    started: bool = False
    protected: bool = False          # in protected resume: its reservation is held until its first new token
    admit_time: float | None = None
    first_token_time: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cache: bool = False              # takes part in the context cache (engine has one, request allows)
    session_key: str | None = None   # context-cache session hint (publication order = ticket)
    cache_points: tuple[int, ...] = ()  # prompt offsets to checkpoint at (PreparedPrompt.cache_points)
    media: tuple[MediaInput, ...] = ()  # the prompt's images and videos, passed to every open of its sequence
    cached_tokens: int = 0           # prompt tokens its first admission restored from a cache checkpoint

    @property
    def seed(self) -> int:
        assert self.params.seed is not None
        return self.params.seed

    def move(self, new: RequestState) -> None:
        """Take one lifecycle transition; an illegal one is an engine failure (a worker bug)."""
        if new not in _TRANSITIONS[self.state]:
            raise EngineFailure(f"request {self.request_id}: illegal transition {self.state.value} -> {new.value}")
        self.state = new

    @property
    def ledger_length(self) -> int:
        return len(self.prompt) + len(self.output_tokens)

    def remaining(self, max_context: int) -> int:
        """Tokens this request may still accept: its max_tokens budget and the context limit."""
        return min(self.params.max_tokens - len(self.output_tokens), max_context - self.ledger_length)

    def row_sampling(self) -> RowSampling:
        """The next sampled token's parameters; a constrained session adds its allowed-token mask,
        which follows its committed output (the matcher's state survives pause and Replay)."""
        mask = self.session.token_mask()
        return RowSampling(self.params, self.seed, len(self.output_tokens), mask)

    def rebuild_target(self) -> int:
        """How many ledger tokens must be computed before this resident is decode-ready: a fresh
        prefill computes the whole prompt (its last chunk samples), a Replay all but the last token."""
        if self.state is RequestState.REPLAY:
            return self.ledger_length - 1
        return len(self.prompt)
