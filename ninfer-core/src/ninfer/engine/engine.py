"""The public facade: :class:`Engine`. Everything a user touches (Python API, CLI, HTTP) goes through it.

Threads: ``submit``, ``stats``, ``close`` and every handle method may be called from any thread.
Request state, the Scheduler and the Program belong to the engine worker (see
:mod:`ninfer.engine.worker`); this facade only validates, enqueues and reads snapshots.

Outstanding capacity: at most ``max_concurrency + queue_capacity`` submitted requests are
outstanding; a request stops counting once its terminal event is published *and* its handle was
released (terminal event read, ``release()``, or the handle dropped). Beyond it, submit raises
QueueFullError.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import queue
import secrets
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ninfer.contracts.errors import EngineClosedError, EngineFailure, InvalidRequestError, QueueFullError
from ninfer.contracts.events import GenerationResult
from ninfer.contracts.frontend import Frontend, OutputOptions, PreparedPrompt
from ninfer.contracts.memory import MemorySummary
from ninfer.contracts.options import EngineOptions, InvalidEngineOptions
from ninfer.contracts.program import CheckpointProgram, Program, ProgramError, WarmupLimits
from ninfer.contracts.request import GenerationRequest
from ninfer.contracts.sampling import SamplingParams
from ninfer.engine.api_checks import (
    check_chat,
    check_request_keywords,
    looks_like_messages,
    options_with,
    token_ids_of_array,
)
from ninfer.engine.handle import GenerationHandle, RequestControl
from ninfer.engine.requests import RequestRecord
from ninfer.engine.stats import EngineStats
from ninfer.engine.worker import WAKE, EngineCore
from ninfer.errors import NotSupportedError

_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_REQUEST_KEYWORDS = ("sampling", "output", "deadline", "timeout_s", "request_id", "cache", "session")

PromptInput = GenerationRequest | PreparedPrompt | str | Sequence[int]

log = logging.getLogger("ninfer.engine")


class Engine:
    """One resident model serving up to ``max_concurrency`` requests at once.

    Build it with :meth:`start` (a model: an artifact, a checkpoint folder or the default model) or
    :meth:`from_parts` (an existing Program and Frontend). Use it as a context manager or call :meth:`close`.

    The purpose is fixed at start. ``generation`` (default): a worker and scheduler serve
    :meth:`submit`. ``causal_scoring``: no worker, scheduler or context cache; :meth:`score` runs
    windows serially on one sequence (max_concurrency is 1) and :meth:`submit` is refused. A
    generation engine refuses :meth:`score`.
    """

    def __init__(self, program: Program, frontend: Frontend, options: EngineOptions, *,
                 info: Mapping[str, Any] | None = None, _owned: Any = None) -> None:
        # start passes the plan's options, already resolved; the purpose rules are idempotent.
        # These import torch: not at module import.
        from ninfer.planning.resolution import check_speculative, warmup_enabled

        options = options.validate()
        check_speculative(options)
        if options.context_cache is None and not _has_checkpoint_slots(program):
            options = dataclasses.replace(options, context_cache=False)  # the default, on a Program without them
        options = options.for_purpose()
        cap = program.capacity()
        if cap.total_state_slots < options.max_concurrency:
            raise InvalidEngineOptions(f"max_concurrency {options.max_concurrency} exceeds the Program's "
                                       f"{cap.total_state_slots} state slots")
        if cap.total_pages * cap.page_size < options.max_context:
            raise InvalidEngineOptions(f"the KV pool holds {cap.total_pages * cap.page_size} tokens, fewer than "
                                       f"max_context {options.max_context}: one request must always fit")
        if program.max_context < options.max_context:
            raise InvalidEngineOptions(f"max_context {options.max_context} exceeds the Program's {program.max_context}")
        if options.context_cache and not _has_checkpoint_slots(program):
            raise InvalidEngineOptions("context_cache needs a Program with checkpoint slots (build it with "
                                       "ProgramOptions.checkpoint_slots >= 1)")
        if options.context_cache:
            # Before the worker starts (it is the only caller afterwards); fixed for the engine's life.
            program.configure_host_tier(options.host_budget_bytes)
        self._program = program
        self._frontend = frontend
        self._options = options
        self._info = dict(info or {})
        self._owned = _owned  # keeps model resources alive as long as the engine
        if warmup_enabled(program.device, options):
            self._warm_up(program, options)
        routing = None
        if options.expert_routing_file is not None:   # after the warm-up, which resets the caches' counts
            from ninfer.engine.expert_routing import RoutingRecorder

            routing = RoutingRecorder.start(options.expert_routing_file, program)
        self._vocab_size = int(program.vocab_size)
        self._defaults = {k: v for k, v in dict(frontend.sampling_defaults()).items() if k in _SAMPLING_FIELDS}
        self._tickets = itertools.count()
        self._outstanding = 0
        self._submitted = 0
        self._released: queue.SimpleQueue = queue.SimpleQueue()  # finalizer-safe release notices
        self._scorer = None
        if options.purpose == "causal_scoring":
            from ninfer.scoring.score_core import CausalScoreCore

            self._scorer = CausalScoreCore(
                program, frontend, max_context=options.max_context, prefill_chunk_size=options.prefill_chunk,
                device=options.device or str(program.device),
                dtype=options.dtype or str(program.dtype or "unknown").removeprefix("torch."),
                info=self._info)
            self._core = None
            self._scoring_closed = False
            return
        self._core = EngineCore(program, options, routing)
        self._core_closing = False
        self._core.start()
        # A forgotten engine still stops its worker (at collection or interpreter exit).
        self._finalizer = weakref.finalize(self, _stop_core, self._core)

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def start(cls, model: str | os.PathLike | None = None, options: EngineOptions | None = None, *,
              progress: Callable[[int, int], None] | None = None, **overrides: Any) -> Engine:
        """Load a model and start serving it.

        ``model``: a ``.ninfer`` artifact (a missing one raises ArtifactNotFoundError); None (the default)
        is the default model an installed plugin ships; a folder is a Hugging Face checkpoint; a shipped
        default model's name or a Hugging Face repo id (``owner/name[@revision]``, from the Hugging Face
        cache, else downloaded) names one too. All but an artifact are converted once into the cache
        (:mod:`ninfer.model_source`).
        ``overrides`` replace fields of ``options`` (e.g. ``Engine.start(path, max_concurrency=2)``) and
        are validated before any conversion; ``progress(bytes_read, total)`` reports weight loading."""
        from ninfer.engine.model_construction import build_model
        from ninfer.engine.start_thread import on_start_thread
        from ninfer.model_source import resolve_model
        from ninfer.planning.resolution import check_speculative

        begun = time.perf_counter()
        options = options_with(options, overrides)
        if model is not None and not os.fspath(model).strip():
            raise InvalidEngineOptions("the model is an empty string: give an artifact, a folder, a default model's "
                                       "name or a repo id, or None for the default model")
        check_speculative(options)  # before any conversion, like the other options
        named_artifact = model is not None and (Path(model).is_file() or os.fspath(model).endswith(".ninfer"))
        artifact = model if named_artifact else resolve_model(model, draft=options.speculative)
        resolved = time.perf_counter()

        def build() -> Engine:
            built = build_model(artifact, options, progress=progress)
            return cls(built.program, built.frontend, built.options, info=built.info, _owned=built)

        # Load, warm-up and worker start on a thread that then ends, taking its OpenMP pool with it (start_thread).
        engine = on_start_thread(build)
        startup = engine._info.setdefault("startup", {})
        startup.update(resolve_s=resolved - begun, total_s=time.perf_counter() - begun)
        return engine

    @classmethod
    def from_parts(cls, program: Program, frontend: Frontend, options: EngineOptions | None = None,
                   **overrides: Any) -> Engine:
        """Serve an already built Program and Frontend (options' KV sizing fields are ignored: the
        Program's capacity is what it is). The purpose's rules apply (``EngineOptions.for_purpose``); the
        default context cache is on when the Program has checkpoint slots."""
        options = options_with(options, overrides)
        return cls(program, frontend, options)

    def _warm_up(self, program: Program, options: EngineOptions) -> None:
        """The start-up warm-up (``EngineOptions.warmup``), before the worker exists; its figures go to
        ``info["startup"]``."""
        from ninfer.planning.resolution import speculative_tokens

        limits = WarmupLimits(max_rows=options.max_concurrency, prefill_chunk=options.prefill_chunk,
                              step_tokens=options.step_tokens, speculative_tokens=speculative_tokens(options))
        summary = program.warm_up(limits)
        self._info.setdefault("startup", {}).update(
            warmup_s=summary.seconds, warmup_units=summary.units, warmup_tokens=summary.tokens,
            warmup_skipped=summary.skipped)
        log.info("start-up warm-up: %d units, %d tokens in %.2f s (%d skipped)", summary.units, summary.tokens,
                 summary.seconds, summary.skipped)

    # -- properties --------------------------------------------------------------------------------
    @property
    def frontend(self) -> Frontend:
        return self._frontend

    @property
    def options(self) -> EngineOptions:
        return self._options

    @property
    def info(self) -> dict[str, Any]:
        """What the engine serves (architecture, public name, ...) when built from an artifact. ``startup``:
        start-up seconds by phase (``resolve_s``: finding or converting the model, ``load_s``: planning, loading
        and building the Program, ``graphs_s``: graph capture and calibration (``prefill_graphs_s``: of which the
        last capture of the prefill-step graphs, when there are any), ``warmup_s``: the warm-up,
        with its ``warmup_units`` and ``warmup_tokens``; ``total_s``: all of :meth:`start`); an engine built with
        :meth:`from_parts` has only the warm-up's, when it ran one."""
        return dict(self._info)

    def memory_summary(self) -> MemorySummary | None:
        """Where device memory went at start (weights, KV/State, workspace, headroom; also
        ``info["memory"]``). None for an engine built with :meth:`from_parts`: nothing was planned."""
        return getattr(self._owned, "memory", None)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_context(self) -> int:
        return self._options.max_context

    @property
    def failure(self) -> EngineFailure | None:
        return self._core.failure if self._core is not None else None

    @property
    def purpose(self) -> str:
        return self._options.purpose

    # -- requests ----------------------------------------------------------------------------------
    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """The model's sampling defaults (generation_config) with ``overrides`` on top, validated."""
        return SamplingParams(**{**self._defaults, **overrides}).validate(self._vocab_size)

    def submit(self, request: PromptInput, *, sampling: SamplingParams | None = None,
               output: OutputOptions | None = None, deadline: float | None = None,
               timeout_s: float | None = None, request_id: str | None = None,
               cache: bool | None = None, session: str | None = None, **sampling_fields: Any) -> GenerationHandle:
        """Enqueue a request and return its handle.

        ``request`` is a GenerationRequest (the keyword arguments must then be left out), or a prompt:
        a PreparedPrompt, token ids, or text (prepared with ``Frontend.prepare_text``); a list of chat
        messages is refused (InvalidRequestError pointing to :meth:`chat`). Sampling is either
        ``sampling=SamplingParams(...)`` or SamplingParams fields as keywords (``temperature=0.7,
        max_tokens=64``) laid over the model's defaults (:meth:`sampling_params`); neither: the model's
        defaults. An unknown keyword raises TypeError naming it. ``timeout_s`` is a relative deadline.
        ``cache=False`` keeps the request out of the context cache (see ``GenerationRequest.cache``);
        ``session`` is a context-cache session key (see ``GenerationRequest.session``). Raises
        synchronously: InvalidRequestError, PromptTooLongError, InvalidSamplingParams, QueueFullError,
        EngineClosedError, EngineFailure; NotSupportedError on an engine started for causal scoring.
        """
        if self._scorer is not None:
            raise NotSupportedError("this engine was started with purpose 'causal_scoring': it scores texts "
                                    "with score() and serves no requests (start another with purpose "
                                    "'generation')")
        sampling = self._keyword_sampling(sampling, sampling_fields)
        req = self._as_request(request, sampling, output, deadline, timeout_s, request_id, cache, session)
        req.validate(vocab_size=self._vocab_size, max_context=self._options.max_context)
        if req.media:
            self._check_media(req)
        params = req.sampling if req.sampling is not None else self.sampling_params()
        if params.seed is None:
            # Drawn here, once, so a Replay after preemption samples exactly the same tokens.
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        out = req.output
        if params.stop_token_ids or params.ignore_eos:
            merged = tuple(dict.fromkeys(out.stop_token_ids + tuple(params.stop_token_ids)))
            out = dataclasses.replace(out, stop_token_ids=merged, ignore_eos=out.ignore_eos or params.ignore_eos)
        if isinstance(req.prompt, PreparedPrompt) and req.prompt.thinking_open and not out.thinking_open:
            # The prompt ends inside <think>: the session must start in the reasoning channel.
            out = dataclasses.replace(out, thinking_open=True)
        rid = req.request_id or f"req-{uuid.uuid4().hex[:16]}"
        # Opened on the submitting thread (grammar compilation and the like happen here, not on the
        # worker); a session holds no engine resources, so a refused request just drops it.
        session = self._frontend.open_session(out)
        core, released = self._core, self._released
        with core.submit_lock:
            self._check_accepting()
            self._collect_releases()
            if self._outstanding >= self._options.outstanding_capacity:
                raise QueueFullError(f"the engine has {self._outstanding} outstanding requests "
                                     f"(capacity {self._options.outstanding_capacity})")
            # The callbacks capture the queues, never the Engine, so a dropped Engine can be collected.
            # The release callback may run in a GC finalizer: a SimpleQueue put is safe there.
            control = RequestControl(rid, wake=lambda: core.inbox.put(WAKE),
                                     on_release=lambda: released.put(None))
            rec = RequestRecord(ticket=next(self._tickets), request_id=rid, prompt=req.prompt_tokens,
                                params=params, session=session, control=control,
                                submit_time=time.monotonic(), deadline=req.deadline,
                                cache=self._options.context_cache and req.cache,
                                session_key=req.session if self._options.context_cache else None,
                                cache_points=req.cache_points, media=req.media)
            self._outstanding += 1
            self._submitted += 1
            core.inbox.put(("submit", rec))
        return GenerationHandle(control)

    def generate(self, request: PromptInput, *, timeout: float | None = None, **kwargs: Any) -> GenerationResult:
        """Submit and wait for the result (raises the request's error). ``kwargs`` are :meth:`submit`'s,
        sampling keywords included (``engine.generate("Hi", max_tokens=32, temperature=0)``); ``timeout``
        bounds the wait in seconds (None: no bound)."""
        with self.submit(request, **kwargs) as handle:
            return handle.result(timeout)

    def chat(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] = (),
             enable_thinking: bool = True, template_kwargs: Mapping[str, Any] | None = None,
             output: OutputOptions | None = None, timeout: float | None = None, **kwargs: Any) -> GenerationResult:
        """Render ``messages`` with the model's chat template (``Frontend.prepare_chat``), generate and
        return the result; ``result.output`` is the parsed answer (``content``, ``reasoning``,
        ``tool_calls``). ``tools`` (JSON-schema function specs) go into the template and, unless ``output``
        names its own, to the tool-call parser. ``enable_thinking`` (default True) lets the model reason
        first; ``template_kwargs`` are further template variables. ``output`` defaults to
        ``OutputOptions()`` (reasoning and tool calls parsed). ``timeout`` and ``kwargs`` are as in
        :meth:`generate`. Anything but a non-empty list of messages with a ``role`` is an
        InvalidRequestError (a plain text prompt goes to :meth:`generate`)."""
        check_chat(messages, tools, enable_thinking, template_kwargs)
        prompt = self._frontend.prepare_chat(list(messages), tools=tuple(tools), enable_thinking=enable_thinking,
                                             **dict(template_kwargs or {}))
        out = output if output is not None else OutputOptions()
        if tools and not out.tools:
            out = dataclasses.replace(out, tools=tuple(tools))
        return self.generate(prompt, timeout=timeout, output=out, **kwargs)

    def _keyword_sampling(self, sampling: SamplingParams | None, fields: Mapping[str, Any]) -> SamplingParams | None:
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams (or give its fields as keywords, e.g. "
                            f"temperature=0.0), got {type(sampling).__name__}")
        if not fields:
            return sampling
        unknown = [k for k in fields if k not in _SAMPLING_FIELDS]
        if unknown:
            raise TypeError(f"unknown keyword argument{'s' if len(unknown) > 1 else ''} "
                            f"{', '.join(map(repr, unknown))}: the sampling keywords are SamplingParams' fields "
                            f"({', '.join(_SAMPLING_FIELDS)}) and the request keywords are "
                            f"{', '.join(_REQUEST_KEYWORDS)} (stop strings: output=OutputOptions(stop=...))")
        if sampling is not None:
            raise TypeError(f"pass either sampling=SamplingParams(...) or sampling keywords "
                            f"({', '.join(fields)}), not both")
        return self.sampling_params(**fields)

    def _as_request(self, request: PromptInput, sampling, output, deadline, timeout_s, request_id, cache=None,
                    session=None) -> GenerationRequest:
        check_request_keywords(output, deadline, timeout_s)
        if timeout_s is not None:
            relative = time.monotonic() + timeout_s
            deadline = relative if deadline is None else min(deadline, relative)
        if isinstance(request, GenerationRequest):
            if any(v is not None for v in (sampling, output, deadline, request_id, cache, session)):
                raise TypeError("pass either a GenerationRequest or a prompt with keyword arguments, not both")
            return request
        if looks_like_messages(request):
            raise InvalidRequestError("the prompt is a list of chat messages: use engine.chat(messages, ...), which "
                                      "renders the model's chat template, or pass "
                                      "engine.frontend.prepare_chat(messages) as the prompt")
        if isinstance(request, (bytes, bytearray)):
            raise InvalidRequestError("the prompt is bytes: decode it to a str for text, or pass token ids as a list "
                                      "of ints")
        if not isinstance(request, (str, PreparedPrompt, list, tuple)) and hasattr(request, "dtype"):
            request = token_ids_of_array(request)   # a 1-D integer numpy array or torch tensor of token ids
        prompt = self._frontend.prepare_text(request) if isinstance(request, str) else request
        return GenerationRequest(prompt=prompt, sampling=sampling, output=output or OutputOptions(),
                                 deadline=deadline, request_id=request_id, cache=True if cache is None else cache,
                                 session=session)

    def _check_media(self, req: GenerationRequest) -> None:
        """A prompt's media against this engine (on the submitting thread, so the worker never meets media its
        Program refuses): vision must be on, the Program must take them with the prompt, and no encode unit may
        exceed the step's encoder budget."""
        media = req.media
        if self._options.vision is False and self._info.get("vision_tower"):
            raise InvalidRequestError(f"the prompt carries {len(media)} image(s)/video(s) but this engine was started "
                                      f"with vision off (--no-vision, EngineOptions.vision=False)")
        try:
            units = self._program.check_media(req.prompt_tokens, None, media)
        except ProgramError as exc:
            raise InvalidRequestError(f"the prompt's media cannot be served: {exc}") from None
        budget = self._options.encode_rows
        for i, rows in enumerate(units):
            if rows > budget:
                raise InvalidRequestError(
                    f"a frame of the prompt's media (encode unit {i}) is {rows:,} patches, above this engine's "
                    f"encoder budget of {budget:,} per step (max_encode_rows, --max-encode-rows): start the engine "
                    f"with max_encode_rows >= {rows} (it reserves more device memory) or send a smaller image")

    def _check_accepting(self) -> None:
        status = self._core.status
        if status == "failed":
            raise EngineFailure(f"the engine failed and accepts no requests: {self._core.failure}")
        if status != "running" or self._core_closing:
            raise EngineClosedError("the engine is closed")

    def _collect_releases(self) -> None:
        while True:
            try:
                self._released.get_nowait()
            except queue.Empty:
                return
            self._outstanding -= 1

    # -- causal scoring ----------------------------------------------------------------------------
    def score(self, inputs, *, context: int | None = None, stride: int | None = None, logprobs: bool = False,
              top_logprobs: int = 0, progress=None):
        """Score texts (or token lists) with the model: per-text and overall NLL and perplexity,
        optionally per-token log-probabilities (``top_logprobs`` alternatives each). Windows of
        ``context`` input tokens advance by ``stride`` targets (defaults: max_context and half of it);
        see :mod:`ninfer.scoring.windows`. ``progress(scored, total)`` is called as target
        tokens are scored. Returns a :class:`~ninfer.scoring.report.ScoreReport`. Only an
        engine started with purpose ``causal_scoring`` scores; others raise NotSupportedError.
        """
        if self._scorer is None:
            raise NotSupportedError("score() needs an engine started with purpose 'causal_scoring' "
                                    "(e.g. Engine.start(path, purpose='causal_scoring')); this one serves generation")
        if self._scoring_closed:
            raise EngineClosedError("the engine is closed")
        return self._scorer.score(inputs, context=context, stride=stride, logprobs=logprobs,
                                  top_logprobs=top_logprobs, progress=progress)

    # -- observation and shutdown ------------------------------------------------------------------
    def stats(self) -> EngineStats:
        if self._scorer is not None:
            return self._scoring_stats()
        snap = self._core.snapshot
        with self._core.submit_lock:
            self._collect_releases()
            outstanding, submitted = self._outstanding, self._submitted
        cap = snap.capacity
        return EngineStats(
            status=snap.status, queue_depth=snap.queue_depth, running=snap.running, paused=snap.paused,
            outstanding=outstanding, submitted=submitted,
            pages_used=cap.total_pages - cap.free_pages, pages_total=cap.total_pages,
            state_slots_used=cap.total_state_slots - cap.free_state_slots,
            state_slots_total=cap.total_state_slots, page_size=cap.page_size, **snap.counters,
            cache_checkpoints=snap.checkpoints.count, cache_device_bytes=snap.checkpoints.device_bytes,
            cache_host_checkpoints=snap.checkpoints.host_count, cache_host_bytes=snap.checkpoints.host_bytes,
            cache_host_budget_bytes=snap.checkpoints.host_budget_bytes)

    def clear_context_cache(self, timeout: float | None = None) -> None:
        """Drop every context-cache checkpoint (done by the worker; waits up to ``timeout``). Stats
        published after the call reflect it. No-op without a context cache or after close."""
        if self._scorer is not None or not self._options.context_cache:
            return
        done = threading.Event()
        with self._core.submit_lock:
            if self._core.status != "failed" and (self._core.status != "running" or self._core_closing):
                return   # closed: there is no cache left to clear
            self._check_accepting()
            self._core.inbox.put(("clear_cache", done))
        if not done.wait(timeout):
            raise TimeoutError("the engine worker did not clear the context cache in time")
        if self._core.failure is not None:
            raise self._core.failure

    def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stop the engine. ``drain``: finish every accepted request first; otherwise unfinished ones
        end with EngineClosedError. Joins the worker (up to ``timeout``). Idempotent."""
        if self._scorer is not None:
            self._scoring_closed = True
            return
        with self._core.submit_lock:
            self._core_closing = True
            self._core.inbox.put(("close", drain))
        if threading.current_thread() is not self._core.thread:
            self._core.thread.join(timeout)

    @property
    def closed(self) -> bool:
        if self._scorer is not None:
            return self._scoring_closed
        return not self._core.thread.is_alive()

    def _scoring_stats(self) -> EngineStats:
        cap, sc = self._program.capacity(), self._scorer
        return EngineStats(
            status="closed" if self._scoring_closed else "running", queue_depth=0, running=0, paused=0,
            outstanding=0, submitted=0, pages_used=cap.total_pages - cap.free_pages, pages_total=cap.total_pages,
            state_slots_used=cap.total_state_slots - cap.free_state_slots, state_slots_total=cap.total_state_slots,
            page_size=cap.page_size, units=sc.chunks_run, prefill_tokens=sc.tokens_processed)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _has_checkpoint_slots(program: Program) -> bool:
    return isinstance(program, CheckpointProgram) and program.checkpoint_usage().total_slots >= 1


def _stop_core(core: EngineCore) -> None:
    core.inbox.put(("close", False))


__all__ = ["Engine", "EngineOptions", "GenerationHandle"]
