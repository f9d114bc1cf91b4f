"""``POST /v1/completions`` (OpenAI legacy Completions), JSON and SSE.

One prompt per request: text, or token ids (a one-element list of either is accepted too, as the
OpenAI API allows lists); several prompts are a 400 (batch them as separate requests, which the
engine runs concurrently anyway). The prompt is continued as raw text: no chat template, no
reasoning or tool-call parsing. ``echo`` prepends the prompt text. ``logprobs: N`` returns the
legacy logprobs object (chosen token and the N most likely alternatives at each generated position);
``echo`` with ``logprobs``, which in OpenAI's API also scores the prompt's tokens, is refused (400).
``response_format`` and vLLM's ``guided_*`` / ``structured_outputs`` constrain the continuation as in
Chat Completions (ninfer_serve.constraints).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from litestar import Request, Response, post
from ninfer.contracts.frontend import OutputOptions

from ninfer_serve import sampling
from ninfer_serve.constraints import constrain
from ninfer_serve.errors import bad_request
from ninfer_serve.gateway import Gateway
from ninfer_serve.generation import Generation, Outcome, Step, collect_response
from ninfer_serve.logprobs import TokenText, completion_logprobs
from ninfer_serve.openai_models import Completion, CompletionChoice, CompletionRequest, Usage
from ninfer_serve.routes_chat import stop_reason, usage_of
from ninfer_serve.sse import (
    COMMENT_KEEPALIVE,
    KEEPALIVE,
    data_event,
    event_stream,
    openai_events,
    with_keepalive,
)

ENDPOINT = "/v1/completions"


def _prompt(req: CompletionRequest, gw: Gateway) -> tuple[list[int], str | None]:
    """(token ids, prompt text when given as text)."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise bad_request(f"prompt holds {len(p)} prompts; this server takes one prompt per request",
                              param="prompt")
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise bad_request("prompt is empty", param="prompt")
        return gw.encode(p), p
    if not p:
        raise bad_request("prompt is empty", param="prompt")
    vocab = gw.engine.vocab_size
    for i, t in enumerate(p):
        if not 0 <= t < vocab:
            raise bad_request(f"prompt token {t} is outside the vocabulary [0, {vocab})", param=f"prompt[{i}]")
    return list(p), None


def _finish(outcome: Outcome) -> str:
    return {"stop": "stop", "length": "length", "deadline": "length"}.get(outcome.finish_reason, "abort")


@post(ENDPOINT, status_code=200)
async def completions(request: Request) -> Response:
    arrived = time.monotonic()
    gw: Gateway = request.app.state.gateway
    req = await gw.read(request, CompletionRequest, generates=True)
    constrained = constrain(None, response_format=req.response_format, extra=req.model_extra)
    ids, text = await gw.prepare(lambda: _prompt(req, gw), param="prompt")
    budget = sampling.output_budget(req.max_tokens, prompt_tokens=len(ids), max_context=gw.max_context,
                                    field="max_tokens", prompt_field="prompt",
                                    defaulted="max_tokens" not in req.model_fields_set)
    want_lp = req.logprobs is not None
    params = sampling.build(gw.engine, {
        **sampling.openai_fields(req), "logprobs": want_lp or None, "top_logprobs": req.logprobs or None,
    }, max_tokens=budget)
    output = OutputOptions(stop=req.stop_list, parse_reasoning=False, parse_tool_calls=False,
                           constraint=constrained.constraint,
                           min_tokens=sampling.min_tokens(req.min_tokens, budget, "max_tokens",
                                                          source="set" if "max_tokens" in req.model_fields_set
                                                          else "default"),
                           include_stop_str=bool(req.include_stop_str_in_output))
    gen = await gw.submit(ids, sampling=params, output=output, endpoint=ENDPOINT, arrived=arrived, id_prefix="cmpl-",
                    prompt_param="prompt", session=req.prompt_cache_key, constraint_param=constrained.param)
    headers = {"x-request-id": gen.request_id}
    echo = (text if text is not None else gw.frontend.decode(ids)) if req.echo else ""
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        stream = _stream(gw, gen, echo, include_usage, req.logprobs)
        return await event_stream(openai_events(stream, f"completion stream {gen.request_id}"), gen,
                                  headers=headers, admit_wait_s=gw.admit_wait_s)
    got = await collect_response(request, gen)
    lp = (completion_logprobs(got.logprobs, TokenText(gw.frontend), req.logprobs or 0, len(echo))
          if want_lp else None)
    result = Completion(
        id=gen.request_id, created=int(time.time()), model=gw.model_id,
        choices=[CompletionChoice(text=echo + got.text, logprobs=lp, finish_reason=_finish(got.outcome),
                                  stop_reason=stop_reason(got.outcome, tuple(gw.frontend.eos_token_ids)))],
        usage=usage_of(got.outcome))
    return Response(result.model_dump_json().encode(), media_type="application/json", headers=headers)


async def _stream(gw: Gateway, gen: Generation, echo: str, include_usage: bool,
                  top: int | None) -> AsyncIterator[bytes]:
    created = int(time.time())
    tokens = TokenText(gw.frontend)
    offset = len(echo)

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
        payload = Completion(id=gen.request_id, created=created, model=gw.model_id, choices=choices,
                             usage=usage).model_dump(mode="json")
        if not include_usage:
            del payload["usage"]
        return data_event(payload)

    if echo:
        yield chunk([CompletionChoice(text=echo, finish_reason=None)])
    async for item in with_keepalive(gen.events(), gw.config.keepalive_s):
        if item is KEEPALIVE:
            yield COMMENT_KEEPALIVE
        elif isinstance(item, Step):
            text = "".join(d.text for d in item.deltas)
            lp = (completion_logprobs(item.logprobs, tokens, top or 0, offset)
                  if top is not None and item.logprobs else None)
            offset += len(text)
            if text or lp is not None:
                yield chunk([CompletionChoice(text=text, logprobs=lp, finish_reason=None)])
        elif isinstance(item, Outcome):
            yield chunk([CompletionChoice(text="", finish_reason=_finish(item),
                                          stop_reason=stop_reason(item, tuple(gw.frontend.eos_token_ids)))])
            if include_usage:
                yield chunk([], usage_of(item))
