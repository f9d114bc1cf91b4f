"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic Messages API).

Conversion to the chat form the template renders: ``system`` becomes a leading system message;
assistant ``thinking`` blocks become ``reasoning_content``, ``tool_use`` blocks ``tool_calls``; user
``tool_result`` blocks become tool messages (before the user's text, as the API orders them).
``tool_choice`` maps auto/any/tool/none onto auto/required/named/none (see tool_choice); any/tool are
enforced by a tool-call grammar (ninfer_serve.constraints.constrain), so the input satisfies the tool's
``input_schema``.
``thinking: {type: disabled}`` renders with ``enable_thinking=false``; ``enabled``/``adaptive`` or no
``thinking`` keeps the model's default (on for Qwen3.5), and reasoning comes back as ``thinking``
blocks with an empty signature.

Streaming follows the API's event sequence: ``message_start``, ``ping``, per block
``content_block_start`` / ``content_block_delta`` (``thinking_delta``, ``text_delta``,
``input_json_delta``) / ``content_block_stop``, then ``message_delta`` (stop reason, output tokens)
and ``message_stop``; an error after the start is an ``error`` event. Idle streams get ``ping``s.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, Response, post
from ninfer.contracts.frontend import OutputOptions, ToolCall

from ninfer_serve import sampling
from ninfer_serve.anthropic_models import (
    CountTokensRequest,
    CountTokensResponse,
    ImageBlock,
    Message,
    MessageResponse,
    MessagesRequest,
    OutTextBlock,
    OutThinkingBlock,
    OutToolUseBlock,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)
from ninfer_serve.chat_input import TemplateOptions, chat_prompt, template_options, tool_policy
from ninfer_serve.constraints import Constrained, constrain
from ninfer_serve.errors import ApiError, anthropic_body, bad_request
from ninfer_serve.gateway import Gateway
from ninfer_serve.generation import Generation, Outcome, Step, collect_response
from ninfer_serve.media_parts import anthropic_image
from ninfer_serve.sse import KEEPALIVE, event_stream, named_event, with_keepalive
from ninfer_serve.tool_choice import ToolPolicy, transforms_for

ENDPOINT = "/v1/messages"
log = logging.getLogger("ninfer.serve")


def _block_text(blocks: str | list[TextBlock] | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "".join(b.text for b in blocks)


def chat_messages(system: str | list[TextBlock] | None, messages: list[Message]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _block_text(system)})
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text: list[str] = []
        parts: list[dict[str, Any]] = []   # text and images in order, when the message has an image
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if isinstance(block, TextBlock):
                text.append(block.text)
                parts.append({"type": "text", "text": block.text})
            elif isinstance(block, ImageBlock):
                if m.role != "user":
                    raise bad_request("image blocks belong to user messages", param=f"{where}.type")
                parts.append(anthropic_image(block.source, where))
            elif isinstance(block, ThinkingBlock | RedactedThinkingBlock | ToolUseBlock):
                if m.role != "assistant":
                    raise bad_request(f"{block.type} blocks belong to assistant messages", param=f"{where}.type")
                if isinstance(block, ThinkingBlock):
                    reasoning.append(block.thinking)
                elif isinstance(block, ToolUseBlock):
                    calls.append({"id": block.id, "type": "function",
                                  "function": {"name": block.name, "arguments": dict(block.input)}})
            elif isinstance(block, ToolResultBlock):
                if m.role != "user":
                    raise bad_request("tool_result blocks belong to user messages", param=f"{where}.type")
                result = _block_text(block.content)
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {result}" if block.is_error else result})
        if m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif any(p["type"] == "image" for p in parts):
            out.append({"role": "user", "content": parts})
        elif text or not any(isinstance(b, ToolResultBlock) for b in m.content):
            out.append({"role": "user", "content": "".join(text)})
    return out


def _plan(req: CountTokensRequest, parallel: bool = True
          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], ToolPolicy, TemplateOptions, Constrained]:
    """The chat form of a request, its tool policy, template options and output constraint; count_tokens
    plans as messages does, so both render the same prompt."""
    messages = chat_messages(req.system, req.messages)
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in req.tools or ()]
    choice, name = None, None
    if req.tool_choice is not None:
        choice = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[req.tool_choice.type]
        name = req.tool_choice.name
        parallel = parallel and not req.tool_choice.disable_parallel_tool_use
    # any/tool: a tools constraint (valid arguments, after the thinking when it is on), as in Chat Completions.
    policy = tool_policy(tools, choice, name, parallel=parallel)
    # output_config.format: the answer's JSON satisfies the schema (after the thinking when it is on).
    constrained = constrain(policy, schemas=req.output_schemas())
    thinking = None if req.thinking is None or req.thinking.type != "disabled" else False
    options = template_options(None, field="thinking", enable_thinking=thinking)
    return messages, tools, policy, options, constrained


def stop_reason(outcome: Outcome, calls: int, eos_ids: tuple[int, ...]) -> tuple[str, str | None]:
    if outcome.finish_reason == "stop":
        if calls:
            return "tool_use", None
        r = outcome.stop_reason
        if isinstance(r, str):
            return "stop_sequence", r
        return "end_turn", None
    return "max_tokens", None


@post("/v1/messages/count_tokens", status_code=200)
async def count_tokens(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    req = await gw.read(request, CountTokensRequest, generates=False)
    messages, tools, policy, options, _ = _plan(req)
    prompt = await gw.prepare(lambda: chat_prompt(gw.frontend, messages, tools, options, gw.config.media), param="messages")
    return Response(CountTokensResponse(input_tokens=len(prompt.token_ids)).model_dump_json().encode(),
                    media_type="application/json")


@post(ENDPOINT, status_code=200)
async def messages(request: Request) -> Response:
    arrived = time.monotonic()
    gw: Gateway = request.app.state.gateway
    req = await gw.read(request, MessagesRequest, generates=True)
    messages, tools, policy, options, constrained = _plan(req)
    prompt = await gw.prepare(lambda: chat_prompt(gw.frontend, messages, tools, options, gw.config.media), param="messages")
    budget = sampling.output_budget(req.max_tokens, prompt_tokens=len(prompt.token_ids),
                                    max_context=gw.max_context, field="max_tokens", prompt_field="messages")
    params = sampling.build(gw.engine, {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k},
                            max_tokens=budget)
    output = OutputOptions(stop=tuple(req.stop_sequences or ()), tools=tuple(tools),
                           parse_reasoning=True, parse_tool_calls=policy.session_parses_calls,
                           constraint=constrained.constraint)
    gen = await gw.submit(prompt, sampling=params, output=output, endpoint=ENDPOINT, arrived=arrived, id_prefix="msg_",
                    prompt_param="messages", transforms=transforms_for(policy, tools),
                    constraint_param=constrained.param)
    headers = {"request-id": gen.request_id}
    if req.stream:
        return await event_stream(_stream(gw, gen), gen, headers=headers,
                                  admit_wait_s=gw.admit_wait_s)
    got = await collect_response(request, gen)
    blocks: list[Any] = []
    if got.reasoning_text:
        blocks.append(OutThinkingBlock(thinking=got.reasoning_text))
    # An empty text block only when nothing else was said and the answer could be text: a forced call's
    # answer is the call, so one cut by max_tokens leaves the content empty, as the API does.
    if got.text or not (got.tool_calls or blocks or policy.forces_call):
        blocks.append(OutTextBlock(text=got.text))
    blocks.extend(_tool_use(c) for c in got.tool_calls)
    reason, seq = stop_reason(got.outcome, len(got.tool_calls), tuple(gw.frontend.eos_token_ids))
    result = MessageResponse(id=gen.request_id, model=gw.model_id, content=blocks, stop_reason=reason,
                             stop_sequence=seq, usage=Usage(input_tokens=got.outcome.prompt_tokens,
                                                            output_tokens=got.outcome.completion_tokens))
    return Response(result.model_dump_json().encode(), media_type="application/json", headers=headers)


def _tool_use(call: ToolCall) -> OutToolUseBlock:
    return OutToolUseBlock(id=call.id, name=call.name, input=dict(call.arguments))


async def _stream(gw: Gateway, gen: Generation) -> AsyncIterator[bytes]:
    index = -1
    open_kind: str | None = None  # the kind of the open block: "thinking" or "text"
    calls = 0
    output_tokens = 0

    def start(kind: str, block: dict[str, Any]) -> bytes:
        nonlocal index, open_kind
        index += 1
        open_kind = kind
        return named_event("content_block_start", {"type": "content_block_start", "index": index,
                                                   "content_block": block})

    def stop() -> bytes:
        nonlocal open_kind
        open_kind = None
        return named_event("content_block_stop", {"type": "content_block_stop", "index": index})

    def delta(payload: dict[str, Any]) -> bytes:
        return named_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": payload})

    message = MessageResponse(id=gen.request_id, model=gw.model_id, content=[], stop_reason=None,
                              usage=Usage(input_tokens=gen.prompt_tokens, output_tokens=0))
    try:
        yield named_event("message_start", {"type": "message_start", "message": message.model_dump(mode="json")})
        yield named_event("ping", {"type": "ping"})
        async for item in with_keepalive(gen.events(), gw.config.keepalive_s):
            if item is KEEPALIVE:
                yield named_event("ping", {"type": "ping"})
            elif isinstance(item, Step):
                output_tokens += len(item.token_ids)
                for d in item.deltas:
                    if d.tool_calls:
                        for c in d.tool_calls:
                            if open_kind is not None:
                                yield stop()
                            yield start("tool_use", {"type": "tool_use", "id": c.id, "name": c.name, "input": {}})
                            yield delta({"type": "input_json_delta",
                                         "partial_json": json.dumps(dict(c.arguments), ensure_ascii=False)})
                            yield stop()
                            calls += 1
                        continue
                    kind = "thinking" if d.channel == "reasoning" else "text"
                    if open_kind != kind:
                        if open_kind is not None:
                            yield stop()
                        yield start(kind, {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                    else {"type": "text", "text": ""})
                    yield delta({"type": "thinking_delta", "thinking": d.text} if kind == "thinking"
                                else {"type": "text_delta", "text": d.text})
            elif isinstance(item, Outcome):
                if open_kind is not None:
                    yield stop()
                reason, seq = stop_reason(item, calls, tuple(gw.frontend.eos_token_ids))
                yield named_event("message_delta", {"type": "message_delta",
                                                    "delta": {"stop_reason": reason, "stop_sequence": seq},
                                                    "usage": {"output_tokens": item.completion_tokens}})
                yield named_event("message_stop", {"type": "message_stop"})
    except ApiError as err:
        yield named_event("error", anthropic_body(err))
    except Exception:  # noqa: BLE001 - a bug must not leave the client waiting on a half-open stream
        log.exception("messages stream %s failed", gen.request_id)
        yield named_event("error", anthropic_body(ApiError("internal", "internal server error")))
