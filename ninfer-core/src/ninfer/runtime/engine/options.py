"""EngineOptions: everything fixed at engine start."""

from __future__ import annotations

from dataclasses import dataclass

from ninfer.errors import NInferError, NotSupportedError
from ninfer.runtime.contract.features import Purpose, StartupFeatures

MAX_CONCURRENCY_LIMIT = 8


class InvalidEngineOptions(NInferError):
    """An EngineOptions value is out of range; the message names it."""


@dataclass(frozen=True)
class EngineOptions:
    """Startup options of one engine. Invariants checked by :meth:`validate`:

    - ``1 <= max_concurrency <= 8``: resident lanes (requests in prefill, Replay or decode).
    - ``queue_capacity >= 0``: waiting requests beyond the lanes. Outstanding capacity is
      ``max_concurrency + queue_capacity`` handles (paused and finished-but-unreleased ones count).
    - ``queue_timeout_s``: None waits forever, else a request still waiting after it is rejected.
    - ``max_context``: the longest ledger (prompt + output) a request may reach.
    - KV sizing: ``num_pages`` wins; else ``kv_budget_mib``; else enough pages for every lane to hold
      ``max_context`` tokens. Either way the pool must hold one full ``max_context`` request.
    - ``prefill_chunk_size``: the most prompt/Replay tokens one worker cycle processes.
    - ``admission_bypass``: how many times later requests may overtake the queue head that does not
      fit yet (bounded bypass); 0 is strict FIFO.
    - ``device``: None picks cuda when CUDA is present, else cpu. ``dtype`` (float32, bfloat16,
      float16): None picks bfloat16 on CUDA and float32 on the CPU (the model casts its weights).
    - ``purpose``: ``generation`` or ``causal_scoring`` (offline scoring, ``Engine.score``). A scoring
      engine runs one window at a time: its effective ``max_concurrency`` is 1 (the Program is sized
      for one sequence), ``max_context`` is the longest scoring window, the queue and admission
      fields are unused, and it has no context cache.
    """

    max_concurrency: int = 4
    queue_capacity: int = 64
    queue_timeout_s: float | None = None
    max_context: int = 4096
    purpose: Purpose = "generation"
    device: str | None = None
    dtype: str | None = None
    page_size: int = 16
    num_pages: int | None = None
    kv_budget_mib: float | None = None
    prefill_chunk_size: int = 512
    context_cache: bool = False
    admission_bypass: int = 2
    vision: bool = False
    speculative: str | None = None

    def validate(self) -> EngineOptions:
        def bad(name: str, why: str) -> InvalidEngineOptions:
            return InvalidEngineOptions(f"invalid engine option {name}={getattr(self, name)!r}: {why}")

        if not 1 <= self.max_concurrency <= MAX_CONCURRENCY_LIMIT:
            raise bad("max_concurrency", f"must be in 1..{MAX_CONCURRENCY_LIMIT}")
        if self.queue_capacity < 0:
            raise bad("queue_capacity", "must be >= 0")
        if self.queue_timeout_s is not None and not self.queue_timeout_s > 0:
            raise bad("queue_timeout_s", "must be > 0 or None")
        if self.max_context < 2:
            raise bad("max_context", "must be >= 2 (one prompt and one output token)")
        if self.page_size < 1:
            raise bad("page_size", "must be >= 1")
        if self.num_pages is not None and self.num_pages < 1:
            raise bad("num_pages", "must be >= 1")
        if self.kv_budget_mib is not None and not self.kv_budget_mib > 0:
            raise bad("kv_budget_mib", "must be > 0")
        if self.prefill_chunk_size < 1:
            raise bad("prefill_chunk_size", "must be >= 1")
        if self.admission_bypass < 0:
            raise bad("admission_bypass", "must be >= 0")
        if self.purpose not in ("generation", "causal_scoring"):
            raise bad("purpose", "must be 'generation' or 'causal_scoring'")
        if self.purpose == "causal_scoring" and self.context_cache:
            raise bad("context_cache", "a causal_scoring engine keeps no context cache")
        if self.context_cache:
            raise NotSupportedError("the request-level context cache is not supported yet")
        if self.vision:
            raise NotSupportedError("the Vision feature is not supported yet")
        if self.speculative is not None:
            raise NotSupportedError(f"speculative backend {self.speculative!r} is not supported yet")
        return self

    @property
    def outstanding_capacity(self) -> int:
        return self.max_concurrency + self.queue_capacity

    def features(self) -> StartupFeatures:
        return StartupFeatures(vision=self.vision, speculative=self.speculative, purpose=self.purpose)
