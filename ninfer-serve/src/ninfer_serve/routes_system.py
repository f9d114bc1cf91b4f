"""``GET /health``, ``GET /metrics``, ``GET /v1/models`` and ``GET /v1/models/{id}``.

Each also answers ``HEAD`` (load balancers, uptime checkers, ``curl -I``) through the same handler:
the response is the GET's, status and headers included, and the app's ``drop_head_body`` hook sends
it without its body.
"""

from __future__ import annotations

from litestar import HttpMethod, Request, Response, route

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
