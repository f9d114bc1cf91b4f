"""``POST /v1/chat/completions`` (OpenAI Chat Completions), JSON and SSE.

Streaming follows OpenAI/vLLM: a first chunk with the assistant role, then ``reasoning_content`` and
``content`` deltas as the engine publishes them, each complete tool call as one ``tool_calls`` delta,
a last choice chunk carrying ``finish_reason``, with ``stream_options.include_usage`` a final chunk
with empty ``choices`` and the usage (every earlier chunk then has ``"usage": null``), then
``data: [DONE]``. An error after the stream started is sent as ``data: {"error": ...}`` before
``[DONE]``.

A forced tool call (``tool_choice`` required or named) answers with ``tool_calls`` only: ``content`` is
null (JSON) and no content delta is streamed. When ``max_tokens`` cuts the call, ``finish_reason`` is
``length`` and the incomplete call is not reported (``tool_calls`` empty, ``content`` null, no markup
streamed); see :mod:`ninfer_serve.tool_choice`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from litestar import Request, Response, post
from ninfer.contracts.frontend import OutputOptions, ToolCall

from ninfer_serve import sampling
from ninfer_serve.chat_input import (
    chat_prompt,
    openai_messages,
    openai_tools,
    template_options,
    thinking_of_effort,
    tool_policy,
)
from ninfer_serve.constraints import constrain
from ninfer_serve.errors import bad_request
from ninfer_serve.gateway import Gateway
from ninfer_serve.generation import Generation, Outcome, Step, collect_response
from ninfer_serve.logprobs import TokenText, chat_logprobs
from ninfer_serve.openai_models import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    DeltaMessage,
    PromptTokensDetails,
    ToolCallDelta,
    ToolCallDeltaFunction,
    ToolCallFunction,
    ToolCallOut,
    Usage,
)
from ninfer_serve.sse import (
    COMMENT_KEEPALIVE,
    KEEPALIVE,
    data_event,
    event_stream,
    openai_events,
    with_keepalive,
)
from ninfer_serve.tool_choice import ToolPolicy, transforms_for

ENDPOINT = "/v1/chat/completions"


def finish_reason(outcome: Outcome, calls: int, policy: ToolPolicy) -> str:
    if outcome.finish_reason == "stop":
        # OpenAI reports a call forced by name as a plain stop, and other calls as "tool_calls".
        return "tool_calls" if calls and policy.mode != "named" else "stop"
    if outcome.finish_reason in ("length", "deadline"):
        return "length"
    return "abort"  # cancelled (vLLM's name); only seen if the client is still there


def stop_reason(outcome: Outcome, eos_ids: tuple[int, ...]) -> str | int | None:
    """vLLM's ``stop_reason``: the stop string or request stop token that ended the output; None for
    the model's own end of turn."""
    r = outcome.stop_reason
    return None if isinstance(r, int) and r in eos_ids else r


def tool_call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=ToolCallFunction(name=call.name,
                                                             arguments=json.dumps(dict(call.arguments),
                                                                                  ensure_ascii=False)))


def usage_of(outcome: Outcome) -> Usage:
    return Usage(prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens,
                 total_tokens=outcome.prompt_tokens + outcome.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=outcome.cached_tokens))


@post(ENDPOINT, status_code=200)
async def chat_completions(request: Request) -> Response:
    arrived = time.monotonic()
    gw: Gateway = request.app.state.gateway
    req = await gw.read(request, ChatCompletionRequest, generates=True)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")

    messages = openai_messages(req.messages)
    tools = openai_tools(req.tools)
    if isinstance(req.tool_choice, str) or req.tool_choice is None:
        policy = tool_policy(tools, req.tool_choice, None, parallel=req.parallel_tool_calls is not False)
    else:
        policy = tool_policy(tools, "named", req.tool_choice.function.name,
                             parallel=req.parallel_tool_calls is not False)
    constrained = constrain(policy, response_format=req.response_format, extra=req.model_extra)
    options = template_options(req.chat_template_kwargs, field="chat_template_kwargs",
                               enable_thinking=thinking_of_effort(req.reasoning_effort), switch="reasoning_effort")
    prompt = await gw.prepare(lambda: chat_prompt(gw.frontend, messages, tools, options, gw.config.media),
                              param="messages")

    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    budget = sampling.output_budget(req.max_completion_tokens or req.max_tokens,
                                    prompt_tokens=len(prompt.token_ids), max_context=gw.max_context,
                                    field=field, prompt_field="messages")
    params = sampling.build(gw.engine, {
        **sampling.openai_fields(req),
        "logprobs": req.logprobs or None, "top_logprobs": req.top_logprobs if req.logprobs else None,
    }, max_tokens=budget)
    output = OutputOptions(stop=req.stop_list, tools=tuple(tools), parse_reasoning=True,
                           parse_tool_calls=policy.session_parses_calls, constraint=constrained.constraint,
                           min_tokens=sampling.min_tokens(req.min_tokens, budget, field, source="context" if (
                               req.max_completion_tokens or req.max_tokens) is None else "set"),
                           include_stop_str=bool(req.include_stop_str_in_output))
    gen = await gw.submit(prompt, sampling=params, output=output, endpoint=ENDPOINT, arrived=arrived,
                    id_prefix="chatcmpl-", prompt_param="messages", transforms=transforms_for(policy, tools),
                    session=req.prompt_cache_key, constraint_param=constrained.param)
    headers = {"x-request-id": gen.request_id}
    top = req.top_logprobs or 0
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        stream = _stream(gw, gen, policy, include_usage=include_usage, logprobs=req.logprobs, top=top)
        return await event_stream(openai_events(stream, f"chat completion stream {gen.request_id}"), gen,
                                  headers=headers, admit_wait_s=gw.admit_wait_s)
    got = await collect_response(request, gen)
    text = got.text
    content = text if text or not (got.tool_calls or policy.forces_call) else None
    completion = ChatCompletion(
        id=gen.request_id, created=int(time.time()), model=gw.model_id, usage=usage_of(got.outcome),
        choices=[ChatChoice(
            message=AssistantMessage(content=content,
                                     reasoning_content=got.reasoning_text or None,
                                     tool_calls=[tool_call_out(c) for c in got.tool_calls]),
            logprobs=chat_logprobs(got.logprobs, TokenText(gw.frontend), top) if req.logprobs else None,
            finish_reason=finish_reason(got.outcome, len(got.tool_calls), policy),
            stop_reason=stop_reason(got.outcome, tuple(gw.frontend.eos_token_ids)))])
    return Response(completion.model_dump_json().encode(), media_type="application/json", headers=headers)


async def _stream(gw: Gateway, gen: Generation, policy: ToolPolicy, *, include_usage: bool, logprobs: bool,
                  top: int) -> AsyncIterator[bytes]:
    created = int(time.time())
    tokens = TokenText(gw.frontend)

    def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> bytes:
        payload = ChatCompletionChunk(id=gen.request_id, created=created, model=gw.model_id, choices=choices,
                                      usage=usage).model_dump(mode="json")
        if not include_usage:
            del payload["usage"]
        return data_event(payload)

    calls = 0
    yield chunk([ChunkChoice(delta=DeltaMessage(role="assistant", content=""))])
    async for item in with_keepalive(gen.events(), gw.config.keepalive_s):
        if item is KEEPALIVE:
            yield COMMENT_KEEPALIVE
        elif isinstance(item, Step):
            lp = chat_logprobs(item.logprobs, tokens, top) if logprobs and item.logprobs else None
            choices = []
            for d in item.deltas:
                if d.tool_calls:
                    deltas = []
                    for c in d.tool_calls:
                        out = tool_call_out(c)
                        deltas.append(ToolCallDelta(index=calls, id=out.id, type="function",
                                                    function=ToolCallDeltaFunction(
                                                        name=out.function.name,
                                                        arguments=out.function.arguments)))
                        calls += 1
                    choices.append(ChunkChoice(delta=DeltaMessage(tool_calls=deltas)))
                elif d.channel == "reasoning":
                    choices.append(ChunkChoice(delta=DeltaMessage(reasoning_content=d.text)))
                else:
                    choices.append(ChunkChoice(delta=DeltaMessage(content=d.text)))
            if lp is not None:
                if choices:
                    choices[0] = choices[0].model_copy(update={"logprobs": lp})
                else:  # tokens whose text is still held back (a partial stop string, say)
                    choices.append(ChunkChoice(delta=DeltaMessage(), logprobs=lp))
            for c in choices:
                yield chunk([c])
        elif isinstance(item, Outcome):
            yield chunk([ChunkChoice(delta=DeltaMessage(), finish_reason=finish_reason(item, calls, policy),
                                     stop_reason=stop_reason(item, tuple(gw.frontend.eos_token_ids)))])
            if include_usage:
                yield chunk([], usage_of(item))
