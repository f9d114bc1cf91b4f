"""One engine replica: an :class:`ninfer.Engine` and the ordinary ``ninfer serve`` app around it, as a Ray
Serve deployment.

The replica does not reimplement the API: :meth:`EngineReplica.handle_request` rebuilds the client's ASGI
request from a :class:`ForwardedRequest`, runs it through :func:`ninfer_serve.create_app`'s app over this
replica's :class:`Gateway`, and yields the app's ASGI messages as they are sent (a streamed answer
streams). The response's start carries :data:`REPLICA_HEADER` with this replica's unique id.

Lifetime: the engine starts (and warms up, unless told not to) in the constructor, so Ray counts the
replica as running only once it can answer; :meth:`check_health` fails once the engine has failed, and
Ray then replaces the replica; Ray's graceful shutdown closes the engine. A cancelled call (the client
went away, the ingress cancelled it) reaches the app as ``http.disconnect``, which cancels the engine
request as it does under uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ninfer_serve.config import ServeConfig
from ninfer_serve.ray_serve.envelope import REPLICA_HEADER, ForwardedRequest

log = logging.getLogger("ninfer.serve")

# How long a cancelled call waits for the app to release its engine request before giving up on it.
_CANCEL_GRACE_S = 10.0


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica starts from.

    - ``model``: an artifact path, a shipped default model's name or a Hugging Face repo id, as
      ``ninfer serve`` takes it (``None``: the default model); resolved by each replica on its own node, so
      a path must exist on every node (or name a model each node can fetch or convert into its cache).
    - ``engine_options``: the :class:`ninfer.contracts.options.EngineOptions` of each replica's engine.
    - ``config``: the server settings; an empty ``model_id`` means the artifact's ``metadata.name``, which
      each replica reads from its own engine (all replicas load the same model, so they agree).
    - ``warmup``: run the serve warm-up request before the replica takes traffic."""

    model: str | None
    engine_options: Any
    config: ServeConfig
    warmup: bool = True


class EngineReplica:
    """The Ray Serve deployment class of one engine replica (wrapped by :func:`serve.deployment` in
    :mod:`ninfer_serve.ray_serve.deploy`)."""

    def __init__(self, spec: ReplicaSpec) -> None:
        from ninfer import Engine
        from ray import serve

        from ninfer_serve.app import create_app
        from ninfer_serve.gateway import Gateway
        from ninfer_serve.warmup import warm_up

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._engine = Engine.start(spec.model, spec.engine_options)
        try:
            if spec.warmup:
                warm_up(self._engine)
            model_id = spec.config.model_id or self._engine.info.get("name") or "ninfer"
            self._gateway = Gateway(self._engine, dataclasses.replace(spec.config, model_id=model_id))
            self._app = create_app(self._gateway)
        except BaseException:
            self._engine.close()
            raise
        log.info("engine replica %s serving %r", self.replica_id, model_id)

    def check_health(self) -> None:
        """Ray calls this periodically; raising makes Ray replace the replica."""
        failure = self._engine.failure
        if failure is not None:
            raise RuntimeError(f"the engine of replica {self.replica_id} failed: {failure}")

    def __del__(self) -> None:
        """Ray's graceful shutdown (after in-flight requests drained, up to its timeout): close the engine."""
        gateway = getattr(self, "_gateway", None)
        if gateway is not None:
            gateway.begin_shutdown()
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.close()

    def _scope(self, req: ForwardedRequest) -> dict[str, Any]:
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": req.method, "scheme": "http", "path": req.path, "raw_path": req.path.encode(),
                "query_string": req.query_string, "root_path": "", "headers": list(req.headers),
                "client": req.client, "server": ("ninfer-replica", 0)}

    async def handle_request(self, req: ForwardedRequest) -> AsyncIterator[dict[str, Any]]:
        """The app's ASGI send messages for ``req``, in order, as they are sent."""
        messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        disconnected = asyncio.Event()
        body_given = False

        async def receive() -> dict[str, Any]:
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (REPLICA_HEADER.encode(), self.replica_id.encode())]
                message = {**message, "headers": headers}
            await messages.put(message)

        async def run() -> None:
            try:
                await self._app(self._scope(req), receive, send)
            finally:
                await messages.put(None)

        task = asyncio.ensure_future(run())
        try:
            while (message := await messages.get()) is not None:
                yield message
            await task  # the app's own exception, if it raised one past its error handler
        finally:
            if not task.done():
                # Cancelled mid-answer: tell the app its client left, and let it release the engine request.
                disconnected.set()
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(task), _CANCEL_GRACE_S)
                task.cancel()
