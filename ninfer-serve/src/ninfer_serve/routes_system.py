"""``GET /health``, ``GET /metrics``, ``GET /v1/models``, ``GET /v1/models/{id}`` and ``POST /reset_prefix_cache``.

Each also answers ``HEAD`` (load balancers, uptime checkers, ``curl -I``) through the same handler:
the response is the GET's, status and headers included, and the app's ``drop_head_body`` hook sends
it without its body.
"""

from __future__ import annotations

import anyio
from litestar import HttpMethod, Request, Response, post, route

from ninfer_serve.errors import MODEL_NOT_FOUND, ApiError
from ninfer_serve.gateway import Gateway
from ninfer_serve.metrics import CONTENT_TYPE
from ninfer_serve.openai_models import ModelCard, ModelList

GET_AND_HEAD = [HttpMethod.GET, HttpMethod.HEAD]


@route("/health", http_method=GET_AND_HEAD)
async def health(request: Request) -> Response:
    """200 ``{"status": "ok"}`` while the engine accepts work; 503 when it failed or closed, or while
    the server shuts down. A full queue is not unhealthy (it is 429 on generation requests)."""
    gw: Gateway = request.app.state.gateway
    status, payload = gw.health()
    return Response(payload, status_code=status)


@route("/metrics", http_method=GET_AND_HEAD)
async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    return Response(gw.metrics.exposition(), media_type=CONTENT_TYPE)


def _card(gw: Gateway) -> ModelCard:
    return ModelCard(id=gw.model_id, created=gw.created, root=gw.model_id, max_model_len=gw.max_context)


@route("/v1/models", http_method=GET_AND_HEAD)
async def list_models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    return Response(ModelList(data=[_card(gw)]).model_dump_json().encode(), media_type="application/json")


@route("/v1/models/{model_id:path}", http_method=GET_AND_HEAD)
async def get_model(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    name = str(request.path_params["model_id"]).lstrip("/")
    if name != gw.model_id:
        raise ApiError("not_found", f"the model '{name}' does not exist; this server serves '{gw.model_id}'",
                       param="model", code=MODEL_NOT_FOUND)
    return Response(_card(gw).model_dump_json().encode(), media_type="application/json")


@post("/reset_prefix_cache", status_code=200)
async def reset_prefix_cache(request: Request) -> Response:
    """Drop every context-cache checkpoint (vLLM's route of the same name): after it, a prompt is computed
    from its first token, and ``/metrics`` shows the KV pages and state slots the running requests hold and
    nothing else. Running requests are unharmed. 200 ``{"status": "ok"}``; also without a context cache."""
    gw: Gateway = request.app.state.gateway
    await anyio.to_thread.run_sync(lambda: gw.engine.clear_context_cache(timeout=60.0))
    return Response({"status": "ok"})
