"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's utility endpoints)."""

from __future__ import annotations

from litestar import Request, Response, post

from ninfer_serve.chat_input import openai_messages, openai_tools, template_options, thinking_of_effort
from ninfer_serve.errors import bad_request
from ninfer_serve.gateway import Gateway
from ninfer_serve.logprobs import TokenText
from ninfer_serve.media_parts import resolve_media
from ninfer_serve.tokenize_models import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)


@post("/tokenize", status_code=200)
async def tokenize(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    req = await gw.read(request, TokenizeRequest, generates=False)
    if req.messages is not None:
        messages = openai_messages(req.messages)
        tools = openai_tools(req.tools)
        options = template_options(req.chat_template_kwargs, field="chat_template_kwargs",
                                   enable_thinking=thinking_of_effort(req.reasoning_effort),
                                   switch="reasoning_effort")
        ids = await gw.prepare(lambda: list(gw.frontend.prepare_chat(
            resolve_media(messages, gw.config.media), tools=tools, enable_thinking=options.enable_thinking,
            add_generation_prompt=req.add_generation_prompt, **options.kwargs).token_ids), param="messages")
    else:
        text = req.prompt or ""
        ids = await gw.prepare(lambda: gw.encode(text), param="prompt")
    strs = [TokenText(gw.frontend).text(t) for t in ids] if req.return_token_strs else None
    out = TokenizeResponse(count=len(ids), max_model_len=gw.max_context, tokens=ids, token_strs=strs)
    return Response(out.model_dump_json().encode(), media_type="application/json")


@post("/detokenize", status_code=200)
async def detokenize(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    req = await gw.read(request, DetokenizeRequest, generates=False)
    vocab = gw.engine.vocab_size
    for i, t in enumerate(req.tokens):
        if not 0 <= t < vocab:
            raise bad_request(f"token {t} is outside the vocabulary [0, {vocab})", param=f"tokens[{i}]")
    text = await gw.prepare(lambda: gw.frontend.decode(req.tokens), param="tokens")
    return Response(DetokenizeResponse(prompt=text).model_dump_json().encode(), media_type="application/json")
