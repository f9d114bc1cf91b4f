"""Request and response models of vLLM's ``/tokenize`` and ``/detokenize``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, StrictInt, model_validator

from ninfer_serve.openai_models import ChatMessage, ChatTool, Lenient, ReasoningEffort


class TokenizeRequest(Lenient):
    """Either ``prompt`` (raw text) or ``messages`` (rendered with the chat template, as a chat request
    would be, with the generation prompt unless ``add_generation_prompt`` is false)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[ChatTool] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[StrictInt]
    token_strs: list[str] | None = None


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str
