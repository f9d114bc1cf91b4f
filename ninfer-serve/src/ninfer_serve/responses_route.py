"""``POST /v1/responses`` (OpenAI Responses API, JSON and SSE), ``GET`` and ``DELETE /v1/responses/{id}``.

A request is translated to the chat path (:mod:`ninfer_serve.responses_input`): the same template
rendering, tool policy, constrained decoding (``text.format``, forced tool calls) and reasoning
parsing as ``/v1/chat/completions``. Sampling: ``temperature`` and ``top_p`` (and the extensions ``top_k`` and ``seed``); ``max_output_tokens``
bounds reasoning and answer together and must fit the context left after the prompt (a 400
``context_length_exceeded`` naming it otherwise); without it the answer may use all of that room.
``reasoning.effort`` ``none``/``minimal`` turns thinking off, the other levels on; without it the
model's default (on). ``prompt_cache_key`` is the context cache's session key, as on Chat Completions.

``store`` (default true) keeps the finished response (:mod:`ninfer_serve.responses_store`);
``previous_response_id`` continues a stored one: its conversation, then the new input. An unknown
(or evicted, or deleted, or never stored) id is a 404 with code ``previous_response_not_found``.
The request id (``resp_...``) is the response's id and the ``x-request-id`` header. ``GET`` (and
``HEAD``) returns a stored response as it was answered; ``DELETE`` forgets it; both 404 for an id the
store does not hold.
"""

from __future__ import annotations

import time

from litestar import Request, Response, delete, post, route
from ninfer.contracts.frontend import OutputOptions

from ninfer_serve import sampling
from ninfer_serve.chat_input import chat_prompt
from ninfer_serve.disconnect import unless_disconnected
from ninfer_serve.errors import ApiError
from ninfer_serve.gateway import Gateway
from ninfer_serve.generation import Generation, Outcome, Step
from ninfer_serve.responses_input import plan
from ninfer_serve.responses_models import DeletedResponse, ResponseObject, ResponsesRequest
from ninfer_serve.responses_output import OutputAssembler, ResponseFrame, conclude
from ninfer_serve.responses_store import ResponseStore
from ninfer_serve.responses_stream import response_events
from ninfer_serve.routes_system import GET_AND_HEAD
from ninfer_serve.sse import event_stream
from ninfer_serve.tool_choice import transforms_for

ENDPOINT = "/v1/responses"
PREVIOUS_NOT_FOUND = "previous_response_not_found"


def _not_found(response_id: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError("not_found", f"Response with id '{response_id}' not found: this server keeps the most recent "
                                 "stored responses in memory only (--responses-store-size)", param=param, code=code)


async def _collect(gen: Generation, assembler: OutputAssembler) -> Outcome:
    outcome = None
    async for item in gen.events():
        if isinstance(item, Step):
            assembler.feed(item)
        else:
            outcome = item
    assert outcome is not None
    return outcome


@post(ENDPOINT, status_code=200)
async def create_response(request: Request) -> Response:
    arrived = time.monotonic()
    gw: Gateway = request.app.state.gateway
    store: ResponseStore = request.app.state.responses
    req = await gw.read(request, ResponsesRequest, generates=True)
    previous = ()
    if req.previous_response_id is not None:
        entry = store.get(req.previous_response_id)
        if entry is None:
            raise _not_found(req.previous_response_id, "previous_response_id", PREVIOUS_NOT_FOUND)
        previous = entry.conversation
    p = plan(req, previous)
    prompt = await gw.prepare(lambda: chat_prompt(gw.frontend, p.messages, p.tools, p.options, gw.config.media), param="input")
    budget = sampling.output_budget(req.max_output_tokens, prompt_tokens=len(prompt.token_ids),
                                    max_context=gw.max_context, field="max_output_tokens", prompt_field="input")
    params = sampling.build(gw.engine, {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                                           "seed": sampling.engine_seed(req.seed)}, max_tokens=budget)
    output = OutputOptions(tools=tuple(p.tools), parse_reasoning=True, parse_tool_calls=p.policy.session_parses_calls,
                           constraint=p.constrained.constraint)
    gen = await gw.submit(prompt, sampling=params, output=output, endpoint=ENDPOINT, arrived=arrived, id_prefix="resp_",
                    prompt_param="input", transforms=transforms_for(p.policy, p.tools), session=req.prompt_cache_key,
                    constraint_param=p.constrained.param)
    frame = ResponseFrame.of(req, response_id=gen.request_id, model=gw.model_id)
    assembler = OutputAssembler(thinking_open=prompt.thinking_open)
    answer_expected = not p.policy.forces_call

    def keep(response: ResponseObject) -> None:
        if req.store and response.status in ("completed", "incomplete"):
            store.put(response, (*p.history, assembler.assistant_turn()))

    headers = {"x-request-id": gen.request_id}
    if req.stream:
        events = response_events(gw, gen, frame, assembler, answer_expected=answer_expected, on_done=keep)
        return await event_stream(events, gen, headers=headers, admit_wait_s=gw.admit_wait_s)
    try:
        outcome = await unless_disconnected(request, _collect(gen, assembler))
    finally:
        gen.close()
    response, _ = conclude(frame, assembler, outcome, answer_expected=answer_expected)
    keep(response)
    return Response(response.model_dump_json().encode(), media_type="application/json", headers=headers)


@route(f"{ENDPOINT}/{{response_id:str}}", http_method=GET_AND_HEAD)
async def retrieve_response(request: Request) -> Response:
    response_id = str(request.path_params["response_id"])
    entry = request.app.state.responses.get(response_id)
    if entry is None:
        raise _not_found(response_id, "response_id")
    return Response(entry.response.model_dump_json().encode(), media_type="application/json")


@delete(f"{ENDPOINT}/{{response_id:str}}", status_code=200)
async def delete_response(request: Request) -> Response:
    response_id = str(request.path_params["response_id"])
    if not request.app.state.responses.delete(response_id):
        raise _not_found(response_id, "response_id")
    return Response(DeletedResponse(id=response_id).model_dump_json().encode(), media_type="application/json")
