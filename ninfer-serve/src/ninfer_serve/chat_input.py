"""Chat input shared by the OpenAI and Anthropic routes: validated protocol messages -> the plain
message dicts the Frontend's chat template renders, and the template options of a request.

The frontend message form is OpenAI's (``role``, string ``content``, assistant ``reasoning_content``
and ``tool_calls`` with object ``arguments``); the Anthropic route converts to it too, so both APIs
render a conversation identically.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ninfer_serve.errors import UNSUPPORTED_VALUE, bad_request
from ninfer_serve.media_parts import openai_part, resolve_media
from ninfer_serve.media_policy import MediaPolicy
from ninfer_serve.openai_models import ChatMessage, ChatTool, ContentPart
from ninfer_serve.tool_choice import ToolPolicy

# Template variables a request must not set through chat_template_kwargs: the server sets them.
RESERVED_TEMPLATE_KEYS = frozenset({"messages", "tools", "add_generation_prompt", "documents"})


def content_of(content: str | Sequence[ContentPart] | None, where: str, *,
               media: bool) -> str | list[dict[str, Any]] | None:
    """A message's content for the frontend: its text, or, when it has image or video parts (``media``: the
    message may carry them), the list of text and media parts in order (media as unresolved references)."""
    if content is None or isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        item = openai_part(part, f"{where}[{j}]")
        if item is not None:
            if not media:
                raise bad_request(f"only user messages may carry {part.type} parts", param=f"{where}[{j}].type",
                                  code=UNSUPPORTED_VALUE)
            parts.append(item)
            continue
        if part.type != "text":
            raise bad_request(f"content parts of type {part.type!r} are not supported (text, image_url and "
                              "video_url are)", param=f"{where}[{j}].type", code=UNSUPPORTED_VALUE)
        if part.text is None:
            raise bad_request("a text content part needs 'text'", param=f"{where}[{j}].text")
        parts.append({"type": "text", "text": part.text})
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _arguments(raw: str | Mapping[str, Any], where: str) -> dict[str, Any]:
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except ValueError as exc:
            raise bad_request(f"tool call arguments are not valid JSON: {exc}", param=where) from None
    else:
        value = raw
    if not isinstance(value, dict):
        raise bad_request("tool call arguments must be a JSON object", param=where)
    return dict(value)


def openai_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        content = content_of(m.content, f"{where}.content", media=m.role == "user")
        if content is None and m.role != "assistant":
            raise bad_request(f"a {m.role} message needs content", param=f"{where}.content")
        msg: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.role == "assistant":
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
            if m.tool_calls:
                msg["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name,
                                  "arguments": _arguments(c.function.arguments,
                                                          f"{where}.tool_calls[{j}].function.arguments")}}
                    for j, c in enumerate(m.tool_calls)]
        elif m.tool_calls:
            raise bad_request("only assistant messages carry tool_calls", param=f"{where}.tool_calls")
        if m.role == "tool" and m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def openai_tools(tools: Sequence[ChatTool] | None) -> list[dict[str, Any]]:
    return [t.model_dump(mode="json", exclude_none=True) for t in tools or ()]


# The model has no reasoning budget, so effort is thinking on or off: every level that asks for reasoning turns
# it on (max_tokens bounds reasoning and answer together); "minimal" asks for next to none, which only off gives.
_THINKING_OF_EFFORT = {"none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True}


def thinking_of_effort(effort: str | None) -> bool | None:
    """OpenAI's ``reasoning_effort`` (already validated by the request model) as ``enable_thinking``;
    None when the request leaves it out."""
    return None if effort is None else _THINKING_OF_EFFORT[effort]


@dataclass(frozen=True)
class TemplateOptions:
    enable_thinking: bool
    kwargs: Mapping[str, Any]


def template_options(kwargs: Mapping[str, Any] | None, *, field: str, enable_thinking: bool | None = None,
                     switch: str | None = None) -> TemplateOptions:
    """``enable_thinking`` comes from the kwargs (``chat_template_kwargs.enable_thinking``) or the
    protocol's own switch (named ``switch``, e.g. ``reasoning_effort``); the model's default (on) otherwise.
    Both given and disagreeing is a 400 naming the switch."""
    rest = dict(kwargs or {})
    bad = sorted(RESERVED_TEMPLATE_KEYS & rest.keys())
    if bad:
        raise bad_request(f"{field} cannot set {', '.join(bad)}: the server sets them from the request",
                          param=f"{field}.{bad[0]}")
    if "enable_thinking" in rest:
        value = rest.pop("enable_thinking")
        if not isinstance(value, bool):
            raise bad_request("enable_thinking must be true or false", param=f"{field}.enable_thinking")
        if enable_thinking is not None and value != enable_thinking:
            raise bad_request(f"{switch} turns thinking {'on' if enable_thinking else 'off'} but "
                              f"{field}.enable_thinking is {str(value).lower()}: set one of them", param=switch)
        enable_thinking = value
    return TemplateOptions(True if enable_thinking is None else enable_thinking, rest)


def tool_policy(tools: Sequence[Mapping[str, Any]], choice: str | None, name: str | None, *,
                parallel: bool, field: str = "tool_choice") -> ToolPolicy:
    """``choice``: none, auto, required or named (``name`` set). Default: auto with tools, else none."""
    names = {t["function"]["name"] for t in tools}
    if choice is None:
        choice = "auto" if tools else "none"
    if choice in ("required", "named") and not tools:
        raise bad_request(f"{field} '{choice if choice != 'named' else name}' needs tools", param=field)
    if choice == "named" and name not in names:
        raise bad_request(f"{field} names the function {name!r}, which is not among the request's tools "
                          f"({', '.join(sorted(names))})", param=field)
    if choice == "auto" and not tools:
        choice = "none"
    return ToolPolicy(choice, name if choice == "named" else None, parallel)  # type: ignore[arg-type]


def chat_prompt(frontend: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                options: TemplateOptions, media: MediaPolicy) -> Any:
    """The PreparedPrompt of a chat request (runs off the event loop: loading its images and videos under the
    server's ``media`` policy, rendering and tokenizing)."""
    messages = resolve_media(messages, media)
    return frontend.prepare_chat(messages, tools=tools, enable_thinking=options.enable_thinking, **options.kwargs)
