"""Request and response models of the OpenAI-compatible API (Chat Completions, Completions, Models).

Requests accept and ignore unknown fields (see :mod:`ninfer_serve.body`). Fields the OpenAI API
defines but this server cannot honour are declared and validated so that only their neutral values
pass: ``n`` > 1, a non-zero ``logit_bias``, audio output, and
``suffix``/``best_of`` > 1 and ``echo`` with ``logprobs`` on Completions are 400s naming the field, and so are
the vLLM extensions whose loss would change the answer (:data:`_VLLM_UNSUPPORTED`). ``response_format`` (text,
json_object, json_schema) and vLLM's ``guided_*`` fields become output constraints
(:mod:`ninfer_serve.constraints`). vLLM extensions that map onto
the engine (``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``,
``include_stop_str_in_output``, ``chat_template_kwargs``) are supported. ``reasoning_effort`` turns thinking off (``none``, ``minimal``)
or on (the other levels), never ignored. ``prompt_cache_key`` (OpenAI's cache-routing key) is the
engine's context-cache session key.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from ninfer_serve.constraints import EXTRA_FIELDS
from ninfer_serve.errors import UnsupportedValue

INT64 = 2**63
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
# OpenAI's reasoning_effort levels; chat_input.thinking_of_effort maps each to thinking on or off.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class Lenient(BaseModel):
    """Unknown fields are kept in ``model_extra`` (logged and ignored), never an error."""

    model_config = ConfigDict(extra="allow")


# -- shared request pieces --------------------------------------------------------------------------
class StreamOptions(Lenient):
    include_usage: bool = False


class ResponseFormat(Lenient):
    """Checked and mapped to a constraint by :func:`ninfer_serve.constraints.body_constraint`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


def _check_stop(value: str | list[str] | None) -> str | list[str] | None:
    stops = [value] if isinstance(value, str) else (value or [])
    if len(stops) > 16:
        raise ValueError("at most 16 stop strings are accepted")
    if any(s == "" for s in stops):
        raise ValueError("stop strings must not be empty")
    return value


# What each refused vLLM extension would need, for its error message (neutral values: None, 0, false, empty).
_VLLM_UNSUPPORTED = {
    "prompt_logprobs": "the prompt's log-probabilities come from `ninfer score`",
    "use_beam_search": "there is no beam search",
    "bad_words": "there are no banned words (a grammar, response_format or guided_*, constrains the output)",
    "allowed_token_ids": "there is no allowed-token list (a grammar, response_format or guided_*, constrains the "
                         "output)",
    "truncate_prompt_tokens": "prompts are not truncated (a prompt longer than the context is a 400)",
}


class SamplingFields(Lenient):
    """Sampling fields shared by Chat Completions and Completions. Range checks follow the OpenAI
    API (and vLLM for the extensions); the engine re-validates what it receives."""

    # Extra fields the routes read from ``model_extra`` (vLLM's output constraints): not "unknown", so
    # body.validate does not log them as ignored.
    READ_FROM_EXTRA: ClassVar[frozenset[str]] = EXTRA_FIELDS

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="vLLM extension; -1 or 0 disables")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None  # strict: a JSON true is not token 1
    ignore_eos: bool = False
    max_tokens: int | None = Field(None, ge=1)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # OpenAI's cache-routing key; here the context-cache session key (docs/context-cache.md).
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=256)
    # vLLM: stop tokens cannot be sampled before the output has this many tokens (OutputOptions.min_tokens). Strict,
    # as the extensions below: a JSON true or "3" is not a count.
    min_tokens: StrictInt | None = Field(None, ge=0)
    # vLLM: the stop string or token that ended the output is part of it (OutputOptions.include_stop_str).
    include_stop_str_in_output: StrictBool | None = None
    # vLLM's sampling extensions that this server does not honour and whose loss would change the output: declared,
    # so that anything but their neutral value is refused by name instead of dropped as an unknown field.
    prompt_logprobs: int | None = None
    use_beam_search: StrictBool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    truncate_prompt_tokens: int | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise UnsupportedValue(f"n={v} is not supported: this server returns exactly one choice per request "
                                   "(n=1)")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        return _check_stop(v)

    @field_validator("stream_options")
    @classmethod
    def _only_streamed(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")   # as vLLM
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v and any(b != 0 for b in v.values()):
            raise UnsupportedValue("non-zero logit_bias is not supported")
        return v

    @field_validator(*_VLLM_UNSUPPORTED)
    @classmethod
    def _vllm_unsupported(cls, v: Any, info: ValidationInfo) -> Any:
        neutral = v is None if info.field_name in ("prompt_logprobs", "truncate_prompt_tokens") else not v
        if not neutral:
            shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
            raise UnsupportedValue(f"{info.field_name}={shown} is not supported: {_VLLM_UNSUPPORTED[info.field_name]}")
        return v

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


# -- chat messages ----------------------------------------------------------------------------------
class ContentPart(Lenient):
    """A content part; only ``text`` parts are served (images and audio need the Vision feature or
    more, which this server does not bind). Checked where messages are converted, so the error names
    the part's position."""

    type: str
    text: str | None = None


class FunctionCall(Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class AssistantToolCall(Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer alias of reasoning_content


class FunctionDefinition(Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        # The name is written into the prompt and parsed back from <function=NAME>: no markup characters.
        if not TOOL_NAME.fullmatch(v):
            raise ValueError("a function name is 1-128 characters of letters, digits, '_', '.', ':' or '-'")
        return v


class ChatTool(Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v: list[str] | None) -> list[str] | None:
        other = [m for m in v or () if m != "text"]
        if other:
            raise UnsupportedValue(f"the modality {other[0]!r} is not supported: this server outputs text only")
        return v

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            raise UnsupportedValue("audio output is not supported")
        return v


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = Field(16, ge=1)  # the OpenAI (and vLLM) default for Completions
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    response_format: ResponseFormat | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("echo")
    @classmethod
    def _no_prompt_logprobs(cls, v: bool, info: ValidationInfo) -> bool:
        # OpenAI's (and vLLM's) echo with logprobs scores the prompt's tokens too, which is how evaluation harnesses
        # compute log-likelihoods; a serving engine computes log-probabilities of generated tokens only, and a reply
        # without the prompt's would be read as wrong scores, not as an error.
        if v and info.data.get("logprobs") is not None:
            raise UnsupportedValue("echo with logprobs (log-probabilities of the prompt's tokens) is not supported: "
                                   "score text with `ninfer score`, or send logprobs without echo for the "
                                   "generated tokens' log-probabilities")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise UnsupportedValue("suffix (fill-in-the-middle) is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise UnsupportedValue(f"best_of={v} is not supported (only 1)")
        return v


# -- responses --------------------------------------------------------------------------------------
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobEntry]


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0   # prompt tokens restored from the context cache instead of computed


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    # Left out when the answer calls no tool, as OpenAI's API does (an empty list there is vLLM's habit).
    tool_calls: list[ToolCallOut] = Field(default_factory=list, exclude_if=lambda calls: not calls)
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None
    stop_reason: str | int | None = None  # vLLM extension: the matched stop string or token id


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ToolCallDeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallDeltaFunction


class DeltaMessage(BaseModel):
    """A streamed delta: only the fields that changed are written (as vLLM and OpenAI do)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: str | int | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ninfer"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
