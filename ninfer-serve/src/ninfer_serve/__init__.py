"""NInfer HTTP gateway: an OpenAI- and Anthropic-compatible API over one ``ninfer.Engine``, on litestar.

``create_app(Gateway(engine, ServeConfig(model_id=...)))`` builds the ASGI app; ``serve(...)`` runs it
under uvicorn; ``ninfer serve`` is the command (:mod:`ninfer_serve.cli`, registered by :mod:`ninfer_serve.plugin`).
The HTTP reference is docs/http.md.

The names below are imported on first use: ``ninfer`` loads this package's plugin for every command, and only
``ninfer serve`` needs the HTTP stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ninfer_serve.app import create_app
    from ninfer_serve.config import ServeConfig
    from ninfer_serve.gateway import Gateway

_EXPORTS = {"create_app": "ninfer_serve.app", "ServeConfig": "ninfer_serve.config", "Gateway": "ninfer_serve.gateway"}

__all__ = ["Gateway", "ServeConfig", "create_app"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ninfer_serve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
