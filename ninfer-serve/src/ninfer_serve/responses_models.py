"""Request and response models of the OpenAI Responses API (``/v1/responses``).

Requests accept and ignore unknown fields (:mod:`ninfer_serve.body`), as the other OpenAI routes do.
Input items are told apart by ``type``; a message item may leave it out (the API's "easy input
message"). Served: message items (roles user, assistant, system, developer; content a string or
``input_text`` / ``output_text`` parts), ``function_call``, ``function_call_output`` and
``reasoning`` items. Fields the API defines but this server cannot honour are 400s naming them with
code ``unsupported_value``: hosted tools (web search, file search, ...), ``background``,
``conversation``, ``truncation: auto``, ``top_logprobs``, ``include`` of output logprobs (other
``include`` values name output this server never produces and change nothing). ``top_k`` and ``seed`` are accepted as
extensions (as on Chat Completions). Content parts other than text are refused where
the input is converted (:mod:`ninfer_serve.responses_input`), so the error names the part's position.

Response objects are built here too: :class:`ResponseObject` is what ``POST`` answers, what
``response.completed`` carries and what ``GET /v1/responses/{id}`` returns.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator, model_validator

from ninfer_serve.errors import UnsupportedValue
from ninfer_serve.openai_models import INT64, TOOL_NAME, Lenient, ReasoningEffort

# The ``include`` values of the Responses API besides logprobs (refused): each names output this server never
# produces, so asking for it changes nothing.
_INCLUDABLE = frozenset({
    "code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
    "message.input_image.image_url", "reasoning.encrypted_content", "web_search_call.action.sources",
    "web_search_call.results",
})


# -- input items ------------------------------------------------------------------------------------
class InputPart(Lenient):
    """A content part; only ``input_text`` and ``output_text`` are served (checked at conversion)."""

    type: str
    text: str | None = None


class MessageInput(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]


class FunctionCallInput(Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str = "{}"


class FunctionCallOutputInput(Lenient):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputPart]


class ReasoningPart(Lenient):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningInput(Lenient):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None


# Tags are the model class names: error locations name the field path only (body.field_path drops them).
_TAGS = {"message": "MessageInput", "function_call": "FunctionCallInput",
         "function_call_output": "FunctionCallOutputInput", "reasoning": "ReasoningInput"}


def _item_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _TAGS.get(kind or "message", str(kind))


InputItem = Annotated[
    Annotated[MessageInput, Tag("MessageInput")] | Annotated[FunctionCallInput, Tag("FunctionCallInput")]
    | Annotated[FunctionCallOutputInput, Tag("FunctionCallOutputInput")]
    | Annotated[ReasoningInput, Tag("ReasoningInput")],
    Discriminator(_item_type, custom_error_type="invalid_item",
                  custom_error_message="an input item's type must be message, function_call, function_call_output "
                                       "or reasoning (other item types are not supported)")]


# -- tools, formats, options -----------------------------------------------------------------------
class FunctionTool(Lenient):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _function_only(cls, v: str) -> str:
        if v != "function":
            raise UnsupportedValue(f"tools of type {v!r} are not supported: this server serves function tools only")
        return v

    @model_validator(mode="after")
    def _named(self) -> FunctionTool:
        if self.name is None or not TOOL_NAME.fullmatch(self.name):
            raise ValueError("a function tool needs a name of 1-128 letters, digits, '_', '.', ':' or '-'")
        return self


class FunctionToolChoice(Lenient):
    type: Literal["function"]
    name: str


class TextFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Lenient):
    format: TextFormat | None = None


class ReasoningConfig(Lenient):
    effort: ReasoningEffort | None = None
    summary: str | None = None  # accepted; the reasoning comes back whole, as reasoning_text content


class ResponsesRequest(Lenient):
    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # vLLM-style extensions (not in OpenAI's Responses API), read as on Chat Completions.
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=256)
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    conversation: Any = None
    top_logprobs: int | None = None
    include: list[str] | None = None

    @field_validator("include")
    @classmethod
    def _include(cls, v: list[str] | None) -> list[str] | None:
        # Every other value the API defines names output this server never produces (hosted tools' results,
        # encrypted reasoning, input image URLs): nothing to include, so a no-op. Log-probabilities would be a silent
        # loss, and an unknown value a typo that OpenAI refuses too.
        for i, item in enumerate(v or ()):
            if item == "message.output_text.logprobs":
                raise UnsupportedValue("include 'message.output_text.logprobs' is not supported on /v1/responses "
                                       "(use /v1/chat/completions with logprobs)")
            if item not in _INCLUDABLE:
                raise ValueError(f"include[{i}] {item!r} is not one of {', '.join(sorted(_INCLUDABLE))}")
        return v

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, v: str | None) -> str | None:
        if v == "auto":
            raise UnsupportedValue("truncation 'auto' is not supported: a conversation longer than the context is a "
                                   "400 (context_length_exceeded)")
        return v

    @field_validator("background")
    @classmethod
    def _no_background(cls, v: bool | None) -> bool | None:
        if v:
            raise UnsupportedValue("background responses are not supported")
        return v

    @field_validator("conversation")
    @classmethod
    def _no_conversation(cls, v: Any) -> Any:
        if v is not None:
            raise UnsupportedValue("conversation objects are not supported; chain responses with previous_response_id")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise UnsupportedValue("top_logprobs is not supported on /v1/responses (use /v1/chat/completions)")
        return v

    @model_validator(mode="after")
    def _some_input(self) -> ResponsesRequest:
        if self.input is None and self.previous_response_id is None:
            raise ValueError("input is required (it may be left out only with previous_response_id)")
        return self


# -- response objects ------------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class MessageItem(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class ReasoningItem(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: ItemStatus
    call_id: str
    name: str
    arguments: str


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
