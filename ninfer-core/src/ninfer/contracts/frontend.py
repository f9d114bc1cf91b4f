"""The Frontend contract: prompt preparation and per-request output interpretation.

The engine never looks at text. It hands provisional tokens to the request's OutputSession for a
*preview* (what would be published, how many tokens to accept, whether the output is finished), and
only after the Program committed the model state does it *commit* the preview and publish its
deltas. A preview that is not committed has no effect (the session is unchanged).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from ninfer.contracts.constraint import OutputConstraint
from ninfer.contracts.field_types import normalize_fields, type_problem

if TYPE_CHECKING:
    from ninfer.contracts.media import MediaInput
    from ninfer.contracts.program import TokenMaskProvider

Channel = Literal["content", "reasoning"]


@dataclass(frozen=True)
class PreparedPrompt:
    """An owning prompt. ``positions`` are MRoPE position ids (3 rows of len(token_ids)) or None for
    plain text positions 0..T-1 (informational: the Program computes the positions it runs with; a prompt with
    media leaves them None). ``media``: the prompt's images and videos
    (:class:`~ninfer.contracts.media.MediaInput`, in token order), whose placeholder spans lie in
    ``token_ids``; the engine carries them to every open of the request's sequence and keys the context cache by
    their digests.
    ``cache_points``: token offsets (ascending, each in ``[1, len(token_ids))``) where a later prompt
    is likely to share this one exactly up to the offset even if what follows is re-rendered, e.g. the
    end of the last complete message before the generation prompt; a context-cache engine
    checkpoints the prefill there (besides its interval boundaries)."""

    token_ids: tuple[int, ...]
    positions: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None = None
    media: tuple[MediaInput, ...] = ()
    thinking_open: bool = False  # the prompt itself ends inside <think> (output starts as reasoning)
    cache_points: tuple[int, ...] = ()


@dataclass(frozen=True)
class ToolCall:
    """A parsed tool call; ``arguments`` are typed by the tool's JSON schema."""

    id: str
    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class OutputDelta:
    """Text newly published on one channel, or tool calls completed in this step."""

    channel: Channel
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class OutputPreview:
    """The effect of a row's provisional tokens. ``accepted`` <= len(tokens) previewed: tokens after a
    stop are not accepted. ``finish_reason`` is ``"stop"`` when a stop token or string ended the output."""

    accepted: int
    finish_reason: str | None
    deltas: tuple[OutputDelta, ...] = ()
    stop_reason: str | int | None = None  # the matched stop string or token id


@dataclass(frozen=True)
class OutputFinal:
    """The end of a session. ``deltas`` are only what :meth:`OutputSession.finish` flushes now (text
    held back until the end, e.g. a partial stop-string match that never completed; never part of an
    earlier preview's deltas): the engine publishes them as the last delta. ``content``,
    ``reasoning`` and ``tool_calls`` are the whole output, published deltas and flush together."""

    deltas: tuple[OutputDelta, ...]
    content: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class OutputOptions:
    """Per-request output interpretation. ``stop_token_ids`` add to the model's EOS ids unless
    ``ignore_eos``; ``stop`` strings are matched across token boundaries and never emitted.
    ``constraint``: the output must satisfy it (constrained decoding; compiled by
    ``Frontend.open_session`` on the submitting thread). ``min_tokens`` (>= 0, vLLM's): the stop tokens
    cannot be sampled before the output has this many tokens, reasoning tokens included
    (:mod:`ninfer.constrained.min_tokens`), and a stop string ends the output only if it completes after them;
    ``max_tokens`` still ends it, and so does a constraint that can only end. ``include_stop_str``: the stop string
    or stop token that ended the output is published with it (vLLM's ``include_stop_str_in_output``; a control
    token such as EOS has no text)."""

    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    tools: tuple[Mapping[str, Any], ...] = ()
    thinking_open: bool = False
    parse_reasoning: bool = True
    parse_tool_calls: bool = True
    extra: Mapping[str, Any] = field(default_factory=dict)
    constraint: OutputConstraint | None = None
    min_tokens: int = 0
    include_stop_str: bool = False

    def __post_init__(self) -> None:
        from ninfer.contracts.errors import InvalidRequestError

        # One stop string given bare is one stop string (as vLLM reads it), not a sequence of characters.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if isinstance(self.tools, list):
            object.__setattr__(self, "tools", tuple(self.tools))
        normalize_fields(self)
        for f in fields(self):
            why = type_problem(getattr(self, f.name), f.type)
            if why is not None:
                raise InvalidRequestError(f"invalid output option {f.name}={getattr(self, f.name)!r}: {why}")
        if self.min_tokens < 0:
            raise InvalidRequestError(f"invalid output option min_tokens={self.min_tokens!r}: must be >= 0")
        if "" in self.stop:
            raise InvalidRequestError("invalid output option stop: a stop string must not be empty")
        if not isinstance(self.tools, tuple) or not all(isinstance(t, Mapping) for t in self.tools):
            raise InvalidRequestError(f"invalid output option tools: must be a sequence of tool specs (mappings), "
                                      f"got {self.tools!r:.80}")
        if not isinstance(self.extra, Mapping):
            raise InvalidRequestError(f"invalid output option extra: must be a mapping, got {type(self.extra).__name__}")
        if self.constraint is not None and not isinstance(self.constraint, OutputConstraint):
            raise InvalidRequestError(f"invalid output option constraint: must be an OutputConstraint (e.g. "
                                      f"OutputConstraint.json_schema(...)), got {type(self.constraint).__name__}")


@runtime_checkable
class OutputSession(Protocol):
    """One request's interpretation of model output, with preview/commit. ``preview`` of a constrained
    session advances its matcher provisionally, ``commit`` keeps that advance, and a newer preview (or
    ``token_mask``) first drops an uncommitted one."""

    def token_mask(self) -> TokenMaskProvider | None:
        """The allowed tokens of the next sampled token, following everything committed (see
        :class:`~ninfer.contracts.program.TokenMaskProvider`); None for an unconstrained session."""

    def preview(self, tokens: Sequence[int]) -> OutputPreview:
        """Interpret ``tokens`` following everything committed so far; pure (no state change)."""

    def commit(self, preview: OutputPreview) -> None:
        """Adopt the last preview. Must be the most recent preview of this session."""

    def finish(self, finish_reason: str) -> OutputFinal:
        """Flush held-back text (e.g. a partial stop-string match that never completed) and close."""


@runtime_checkable
class Frontend(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def prepare_text(self, text: str) -> PreparedPrompt: ...

    def prepare_chat(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] = (),
                     enable_thinking: bool = True, add_generation_prompt: bool = True,
                     **template_kwargs: Any) -> PreparedPrompt: ...

    def open_session(self, options: OutputOptions) -> OutputSession:
        """Called on the submitting thread. Compiles ``options.constraint`` (InvalidConstraintError
        when it does not compile), so the engine worker never compiles."""

    def sampling_defaults(self) -> Mapping[str, Any]:
        """Model-side defaults from generation_config (temperature, top_p, top_k, ...); a request's own
        values win."""


@dataclass(frozen=True)
class FrontendSpec:
    """A frontend family as registered through the ``ninfer_frontends`` hook.

    ``name`` is what an :class:`~ninfer.contracts.architecture.ArchitectureSpec` names in its
    ``frontend`` field; ``create(resources, vocab_size)`` builds the :class:`Frontend` from the
    artifact's Text frontend resources (role -> bytes, only the roles present) and the model's
    vocabulary size (the embedding rows; a tokenizer id at or past it is an error).
    """

    name: str
    create: Any  # Callable[[Mapping[str, bytes], int], Frontend]

