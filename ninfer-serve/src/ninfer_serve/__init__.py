"""NInfer HTTP gateway: an OpenAI- and Anthropic-compatible API over one ``ninfer.Engine``, on litestar.

``create_app(Gateway(engine, ServeConfig(model_id=...)))`` builds the ASGI app; ``serve(...)`` runs it
under uvicorn; ``ninfer serve`` is the command. The HTTP reference is docs/http.md.
"""

from ninfer_serve.app import create_app
from ninfer_serve.config import ServeConfig
from ninfer_serve.gateway import Gateway

__all__ = ["Gateway", "ServeConfig", "create_app"]
