"""What a caller submits to the engine: :class:`GenerationRequest`.

A request is immutable once built. :meth:`GenerationRequest.validate` is called on the submitting
thread, so every representability problem is a synchronous rejection and never reaches the worker.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from ninfer.contracts.errors import InvalidRequestError, PromptTooLongError
from ninfer.contracts.field_types import normalize_fields, type_problem
from ninfer.contracts.frontend import OutputOptions, PreparedPrompt
from ninfer.contracts.media import MediaInput
from ninfer.contracts.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """One generation request.

    - ``prompt``: a :class:`PreparedPrompt` from the Frontend, or plain token ids (any sequence of
      ints; stored as a tuple).
    - ``sampling``: None takes the model's defaults (``Frontend.sampling_defaults``); a ``seed`` of
      None is replaced by a drawn seed at submit, so Replay after preemption reproduces the tokens.
    - ``output``: how the OutputSession interprets tokens (stop strings, tools, ...).
      ``sampling.stop_token_ids`` / ``sampling.ignore_eos`` are merged into it at submit.
    - ``deadline``: absolute ``time.monotonic()`` seconds; past it the request ends (rejected with
      DeadlineExceededError if never admitted, finish_reason ``"deadline"`` otherwise).
    - ``request_id``: caller's id for logs and events; the engine makes one when None.
    - ``cache``: take part in the engine's context cache (when it has one): bind to a cached prefix
      and publish checkpoints. False: computed from the root and leaves nothing behind (warm-up).
    - ``session``: a context-cache session key (a hint, like OpenAI's ``prompt_cache_key``): the
      request's prompt-end and response-end checkpoints are bound to it unless a newer request (later
      submission) already published under it; the bound checkpoint is retained with priority and
      wins lookups among equally long candidates. Ignored without a context cache. 1..256 chars.
    """

    prompt: PreparedPrompt | Sequence[int]
    sampling: SamplingParams | None = None
    output: OutputOptions = field(default_factory=OutputOptions)
    deadline: float | None = None
    request_id: str | None = None
    cache: bool = True
    session: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.prompt, (str, bytes, bytearray)):
            # tuple() would split it into characters, each then "outside the vocabulary".
            raise InvalidRequestError(f"GenerationRequest.prompt is token ids or a PreparedPrompt, not "
                                      f"{type(self.prompt).__name__}: prepare text with Frontend.prepare_text, or pass "
                                      f"it to Engine.submit / generate, which do")
        if not isinstance(self.prompt, PreparedPrompt):
            # Freeze the caller's list so the request stays immutable after submit.
            object.__setattr__(self, "prompt", tuple(self.prompt))
        if self.sampling is not None and not isinstance(self.sampling, SamplingParams):
            raise InvalidRequestError(f"GenerationRequest.sampling must be a SamplingParams or None, got "
                                      f"{type(self.sampling).__name__}")
        if not isinstance(self.output, OutputOptions):
            raise InvalidRequestError(f"GenerationRequest.output must be an OutputOptions, got "
                                      f"{type(self.output).__name__}")
        normalize_fields(self)   # deadline, request_id, cache, session: their annotated types (field_types)
        for f in fields(self):
            why = type_problem(getattr(self, f.name), f.type)
            if why is not None:
                raise InvalidRequestError(f"invalid request field {f.name}={getattr(self, f.name)!r:.40}: {why}")

    @property
    def cache_points(self) -> tuple[int, ...]:
        """The prompt's context-cache points (see PreparedPrompt.cache_points); none for token ids."""
        return tuple(self.prompt.cache_points) if isinstance(self.prompt, PreparedPrompt) else ()

    @property
    def media(self) -> tuple[MediaInput, ...]:
        """The prompt's images and videos (PreparedPrompt.media); none for token ids."""
        return tuple(self.prompt.media) if isinstance(self.prompt, PreparedPrompt) else ()

    @property
    def prompt_tokens(self) -> tuple[int, ...]:
        if isinstance(self.prompt, PreparedPrompt):
            return tuple(self.prompt.token_ids)
        return tuple(self.prompt)

    def validate(self, *, vocab_size: int, max_context: int) -> GenerationRequest:
        """Raise a request-level rejection when the request cannot be served; return self otherwise.

        The prompt must leave room for at least one output token: ``len(prompt) < max_context``.
        """
        tokens = self.prompt_tokens
        if not tokens:
            raise InvalidRequestError("the prompt is empty: at least one token is needed")
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int):
                raise InvalidRequestError(f"prompt token {t!r} is a {type(t).__name__}, not a Python int")
            if not 0 <= t < vocab_size:
                raise InvalidRequestError(f"prompt token {t!r} is outside the vocabulary [0, {vocab_size})")
        if len(tokens) >= max_context:
            raise PromptTooLongError(
                f"the prompt has {len(tokens)} tokens; max_context {max_context} leaves room for at most "
                f"{max_context - 1} prompt tokens")
        self._validate_media(len(tokens))
        if self.sampling is not None:
            self.sampling.validate(vocab_size)
        for t in self.output.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise InvalidRequestError(f"stop token id {t} is outside the vocabulary [0, {vocab_size})")
        points = self.cache_points
        if any(not isinstance(p, int) or isinstance(p, bool) or not 1 <= p < len(tokens) for p in points) or \
                list(points) != sorted(set(points)):
            raise InvalidRequestError(f"cache_points {points!r} must be ascending offsets in [1, {len(tokens)})")
        if self.session is not None and (not isinstance(self.session, str) or not 1 <= len(self.session) <= 256):
            raise InvalidRequestError(f"session must be a string of 1 to 256 characters, got {self.session!r}")
        if self.deadline is not None and not math.isfinite(self.deadline):
            raise InvalidRequestError(f"deadline {self.deadline!r} is not a finite monotonic time")
        return self

    def _validate_media(self, length: int) -> None:
        """The media's shape as a request can state it: MediaInput items whose spans lie in the prompt, in token
        order, never overlapping. Whether they fit the model is the Program's check (the engine runs it)."""
        end = 0
        for i, m in enumerate(self.media):
            if not isinstance(m, MediaInput):
                raise InvalidRequestError(f"prompt media item {i} is a {type(m).__name__}, not a MediaInput (prepare "
                                          f"the prompt with the frontend: Engine.chat or Frontend.prepare_chat)")
            if m.spans[0][0] < end or m.spans[-1][1] > length:
                raise InvalidRequestError(f"prompt media item {i} ({m.kind}) spans {m.spans[0][0]}..{m.spans[-1][1]}: "
                                          f"media must come in token order, apart, inside the {length}-token prompt")
            end = m.spans[-1][1]
