"""The Gateway: what every route shares. It holds the one Engine, the public model id, the metrics
and the server's availability, and turns a prepared request into a running :class:`Generation`.

Availability: ``begin_shutdown`` (called on SIGTERM/SIGINT before the ASGI server drains) makes new
generation requests 503 while in-flight ones finish; an engine that failed or closed is also 503.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from litestar import Request
from ninfer.contracts.frontend import OutputOptions, PreparedPrompt
from ninfer.contracts.sampling import SamplingParams
from ninfer.errors import NInferError
from pydantic import BaseModel

from ninfer_serve import body
from ninfer_serve.config import ServeConfig
from ninfer_serve.errors import MODEL_NOT_FOUND, ApiError, bad_request, from_engine_error
from ninfer_serve.generation import Generation
from ninfer_serve.metrics import ServerMetrics
from ninfer_serve.tool_choice import DeltaTransform

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class Gateway:
    def __init__(self, engine: Any, config: ServeConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = ServerMetrics(engine.stats)
        self.created = int(time.time())
        self._shutting_down = False

    @property
    def model_id(self) -> str:
        return self.config.model_id

    @property
    def frontend(self) -> Any:
        return self.engine.frontend

    @property
    def max_context(self) -> int:
        return int(self.engine.max_context)

    @property
    def admit_wait_s(self) -> float:
        """How long a stream's status line waits for the engine to admit its request (:mod:`ninfer_serve.sse`):
        ``keepalive_s``, or with an engine queue timeout that timeout plus ``keepalive_s``, so that a request the
        queue refuses gets its HTTP 429 even when the engine settles the timeout late (a long step on a loaded
        host), not a 200 followed by an error event that clients do not retry."""
        options = getattr(self.engine, "options", None)
        timeout = getattr(options, "queue_timeout_s", None)
        keep = self.config.keepalive_s
        return keep if not isinstance(timeout, int | float) else float(timeout) + keep

    # -- availability ------------------------------------------------------------------------------
    def begin_shutdown(self) -> None:
        self._shutting_down = True

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down

    def health(self) -> tuple[int, dict[str, str]]:
        if self._shutting_down:
            return 503, {"status": "shutting_down"}
        if self.engine.failure is not None or self.engine.stats().status != "running":
            return 503, {"status": "unavailable"}
        return 200, {"status": "ok"}

    async def read(self, request: Request, model: type[M], *, generates: bool) -> M:
        """The request body validated as ``model`` (400 naming the field), for the served model (404
        otherwise); ``generates``: also refused (503) once the server is shutting down."""
        req = body.validate(model, await request.body())
        self.check_model(getattr(req, "model", None))
        if generates:
            self.check_accepting()
        return req

    def check_accepting(self) -> None:
        if self._shutting_down:
            raise ApiError("unavailable", "the server is shutting down and accepts no new requests")

    def check_model(self, requested: str | None) -> None:
        """vLLM's rule: the model may be left out; when given it must be the served one."""
        if requested is not None and requested != self.model_id:
            raise ApiError("not_found", f"the model '{requested}' does not exist; this server serves "
                                        f"'{self.model_id}'", param="model", code=MODEL_NOT_FOUND)

    # -- prompts -----------------------------------------------------------------------------------
    async def prepare(self, fn: Callable[[], T], *, param: str) -> T:
        """Run a prompt preparation (template rendering, tokenization) off the event loop, so a long
        prompt does not stall other requests' streams. Frontend errors are the request's fault."""
        try:
            return await anyio.to_thread.run_sync(fn)
        except ApiError:
            raise
        except NInferError as exc:
            raise bad_request(str(exc), param=param) from None
        except RecursionError:
            raise bad_request("the request is nested too deeply to render", param=param) from None

    def encode(self, text: str) -> list[int]:
        return list(self.frontend.encode(text))

    # -- generation --------------------------------------------------------------------------------
    async def submit(self, prompt: PreparedPrompt | Sequence[int], *, sampling: SamplingParams,
                     output: OutputOptions, endpoint: str, arrived: float, id_prefix: str, prompt_param: str,
                     transforms: Sequence[DeltaTransform] = (), session: str | None = None,
                     constraint_param: str | None = None) -> Generation:
        """Submit off the event loop: ``Engine.submit`` compiles the request's constraint, native work that
        may take a noticeable time and must not stall every other request's stream. Shielded: once the engine
        has the request, its handle reaches the Generation (which cancels it on a disconnect) instead of being
        dropped by a cancellation that arrives while the thread runs."""
        self.check_accepting()
        request_id = f"{id_prefix}{uuid.uuid4().hex}"
        try:
            with anyio.CancelScope(shield=True):
                handle = await anyio.to_thread.run_sync(functools.partial(
                    self.engine.submit, prompt, sampling=sampling, output=output, request_id=request_id,
                    session=session))
        except NInferError as exc:
            raise from_engine_error(exc, prompt_param=prompt_param, at_submit=True,
                                    constraint_param=constraint_param) from None
        tokens = len(prompt.token_ids) if isinstance(prompt, PreparedPrompt) else len(prompt)
        return Generation(handle, request_id=request_id, prompt_tokens=tokens, metrics=self.metrics,
                          endpoint=endpoint, arrived=arrived, transforms=transforms)
