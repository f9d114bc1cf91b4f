"""A Responses API request -> the chat form the template renders, the tool policy, template options and
output constraint (the same pieces Chat Completions uses, so both APIs render and constrain alike).

Input items map onto chat messages in order:

- a message item is a message of its role (``developer`` is a system message, as OpenAI treats it);
  its text parts are joined; any other part type is a 400 naming it;
- ``reasoning`` items are held and become the ``reasoning_content`` of the next assistant turn (an
  assistant turn of their own, with empty content, when no assistant item follows them: the turn of
  an answer cut short in its reasoning, as the store keeps it);
- ``function_call`` items join the assistant turn just before them (or open one), as its
  ``tool_calls``; ``function_call_output`` items become tool messages.

``instructions`` is a leading system message; with ``previous_response_id`` the conversation is the
stored chain's (:mod:`ninfer_serve.responses_store`) followed by the new input. ``text.format``
becomes the ``response_format`` constraint and ``tool_choice`` the tool policy; errors name the
Responses field (``text.format.schema``, ``tool_choice``), not the Chat Completions one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ninfer_serve.chat_input import TemplateOptions, template_options, thinking_of_effort, tool_policy
from ninfer_serve.constraints import Constrained, constrain
from ninfer_serve.errors import UNSUPPORTED_VALUE, ApiError, bad_request
from ninfer_serve.responses_models import (
    FunctionCallInput,
    FunctionCallOutputInput,
    InputPart,
    MessageInput,
    ReasoningInput,
    ResponsesRequest,
)
from ninfer_serve.tool_choice import ToolPolicy

TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
# Chat Completions field names in constraint errors -> the Responses fields they came from.
_PARAMS = {"response_format": "text.format", "response_format.type": "text.format.type",
           "response_format.json_schema.schema": "text.format.schema"}


def _text(content: str | Sequence[InputPart], where: str) -> str:
    if isinstance(content, str):
        return content
    out = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS:
            raise bad_request(f"content parts of type {part.type!r} are not supported: this server serves text only",
                              param=f"{where}[{j}].type", code=UNSUPPORTED_VALUE)
        if part.text is None:
            raise bad_request("a text content part needs 'text'", param=f"{where}[{j}].text")
        out.append(part.text)
    return "".join(out)


def _arguments(raw: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(raw) if raw.strip() else {}
    except ValueError as exc:
        raise bad_request(f"function call arguments are not valid JSON: {exc}", param=where) from None
    if not isinstance(value, dict):
        raise bad_request("function call arguments must be a JSON object", param=where)
    return value


def input_messages(items: str | Sequence[Any] | None) -> list[dict[str, Any]]:
    """The chat messages of a request's ``input`` (module docstring)."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []

    def assistant_turn() -> dict[str, Any]:
        """A new assistant turn, carrying the reasoning held for it."""
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        out.append(msg)
        return msg

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if isinstance(item, ReasoningInput):
            reasoning.extend(p.text for p in (item.content or item.summary))
            continue
        if isinstance(item, MessageInput) and item.role == "assistant":
            assistant_turn()["content"] = _text(item.content, f"{where}.content")
            continue
        if isinstance(item, FunctionCallInput):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": _arguments(item.arguments, f"{where}.arguments")}}
            last = out[-1] if out and out[-1]["role"] == "assistant" and not reasoning else assistant_turn()
            last.setdefault("tool_calls", []).append(call)
            continue
        if reasoning:  # reasoning with no answer after it (cut short): a turn of its own, as the store keeps it
            assistant_turn()
        if isinstance(item, MessageInput):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _text(item.content, f"{where}.content")})
        elif isinstance(item, FunctionCallOutputInput):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, f"{where}.output")})
        else:  # the request model admits no other item
            raise TypeError(f"unexpected input item {type(item).__name__}")
    if reasoning:
        assistant_turn()
    return out


def chat_tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.parameters or {"type": "object", "properties": {}}}}
            for t in req.tools or ()]


def request_policy(req: ResponsesRequest, tools: list[dict[str, Any]]) -> ToolPolicy:
    parallel = req.parallel_tool_calls is not False
    if isinstance(req.tool_choice, str) or req.tool_choice is None:
        return tool_policy(tools, req.tool_choice, None, parallel=parallel)
    return tool_policy(tools, "named", req.tool_choice.name, parallel=parallel)


def request_constraint(req: ResponsesRequest, policy: ToolPolicy) -> Constrained:
    fmt = req.text.format if req.text is not None else None
    response_format = None
    if fmt is not None:
        if fmt.type == "json_schema" and fmt.schema_ is None:
            raise bad_request("text.format json_schema needs 'schema', a JSON Schema object", param="text.format.schema")
        response_format = {"type": fmt.type}
        if fmt.type == "json_schema":
            response_format["json_schema"] = {"name": fmt.name, "schema": fmt.schema_}
    try:
        constrained = constrain(policy, response_format=response_format)
    except ApiError as err:
        err.param = _PARAMS.get(err.param or "", err.param)
        err.message = err.message.replace("response_format", "text.format")
        raise
    return Constrained(constrained.constraint, _PARAMS.get(constrained.param or "", constrained.param))


def request_options(req: ResponsesRequest) -> TemplateOptions:
    effort = req.reasoning.effort if req.reasoning is not None else None
    return template_options(None, field="reasoning", enable_thinking=thinking_of_effort(effort),
                            switch="reasoning.effort")


@dataclass(frozen=True)
class Plan:
    """What a request renders and how its output is held: ``history`` is the conversation without
    instructions (what the store keeps), ``messages`` what the template renders."""

    history: tuple[Mapping[str, Any], ...]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    policy: ToolPolicy
    options: TemplateOptions
    constrained: Constrained


def plan(req: ResponsesRequest, previous: Sequence[Mapping[str, Any]]) -> Plan:
    """``previous``: the stored conversation of ``previous_response_id`` (empty without one)."""
    history = (*previous, *input_messages(req.input))
    if not history:
        raise bad_request("the conversation is empty: give input", param="input")
    messages = [dict(m) for m in history]
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    tools = chat_tools(req)
    policy = request_policy(req, tools)
    return Plan(history, messages, tools, policy, request_options(req), request_constraint(req, policy))
