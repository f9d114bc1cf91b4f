"""Request and response models of the Anthropic Messages API (``/v1/messages``, ``count_tokens``).

Content blocks are validated by type (a discriminated union): text, thinking, redacted_thinking,
tool_use and tool_result are served; image and document blocks are 400s (this server serves text
only). Server tools (``web_search`` and the like, which carry a ``type``) are 400s: only client tools
(``name`` + ``input_schema``) are served. Structured outputs (``output_config.format``, or the beta's
``output_format``: a JSON Schema) constrain the answer as ``response_format`` does on Chat Completions.
``thinking.budget_tokens`` is accepted but not enforced (the engine has no thinking budget yet): ``max_tokens``
bounds reasoning and answer together.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from ninfer_serve.openai_models import TOOL_NAME, Lenient, _check_stop


class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class ThinkingBlock(Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Lenient):
    type: Literal["redacted_thinking"]
    data: str = ""


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False


class ImageBlock(Lenient):
    """An image: ``source`` {type: base64, media_type, data} or {type: url, url}, checked where messages are
    converted (:func:`ninfer_serve.media_parts.anthropic_image`), so the error names the block's position."""

    type: Literal["image"]
    source: dict[str, Any]


class UnsupportedBlock(Lenient):
    type: Literal["document", "search_result", "server_tool_use", "web_search_tool_result"]

    @model_validator(mode="after")
    def _refuse(self) -> UnsupportedBlock:
        raise ValueError(f"content blocks of type {self.type!r} are not supported: this server serves text only")


ContentBlock = Annotated[
    TextBlock | ImageBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock | UnsupportedBlock,
    Field(discriminator="type")]


class Message(Lenient):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(Lenient):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    type: str | None = None

    @model_validator(mode="after")
    def _client_tool(self) -> Tool:
        if self.type not in (None, "custom"):
            raise ValueError(f"server tool type {self.type!r} is not supported; only client tools (name + "
                             "input_schema) are served")
        if not TOOL_NAME.fullmatch(self.name):
            raise ValueError("a tool name is 1-128 characters of letters, digits, '_', '.', ':' or '-'")
        return self


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice type 'tool' needs the tool's name")
        return self


class Thinking(Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class OutputFormat(Lenient):
    """Structured outputs: the answer's text is JSON satisfying ``schema`` (a grammar, as response_format)."""

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")

    @model_validator(mode="before")
    @classmethod
    def _type_first(cls, data: Any) -> Any:
        # A wrong type is the real mistake: without this the missing 'schema' (a longer field path) is reported.
        if isinstance(data, dict) and "type" in data and data["type"] != "json_schema":
            raise ValueError(f"type must be 'json_schema' (the one output format served), got {data['type']!r}")
        return data


class OutputConfig(Lenient):
    """``format`` is served; ``effort`` is accepted and changes nothing (no thinking budget yet)."""

    format: OutputFormat | None = None
    effort: str | None = None


class CountTokensRequest(Lenient):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None   # the structured-outputs beta's spelling of output_config.format

    def output_schemas(self) -> dict[str, dict[str, Any]]:
        """Field path -> the JSON Schema the answer must satisfy (two of them are a 400 at planning)."""
        out = {}
        if self.output_config is not None and self.output_config.format is not None:
            out["output_config.format.schema"] = self.output_config.format.json_schema
        if self.output_format is not None:
            out["output_format.schema"] = self.output_format.json_schema
        return out


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        return _check_stop(v)  # type: ignore[return-value]


# -- responses --------------------------------------------------------------------------------------
class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class OutTextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class OutThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # NInfer does not sign reasoning; an empty signature is passed back unchecked


class OutToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


OutBlock = OutTextBlock | OutThinkingBlock | OutToolUseBlock


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int
