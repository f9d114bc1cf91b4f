"""Scale-out of ``ninfer serve`` on Ray Serve (docs/scale-out.md): N engine replicas behind one ingress.

- :mod:`~ninfer_serve.ray_serve.replica`: one engine and the ordinary ``ninfer serve`` app, per replica.
- :mod:`~ninfer_serve.ray_serve.ingress`: the HTTP proxy relaying each request to a replica.
- :mod:`~ninfer_serve.ray_serve.affinity` and :mod:`~ninfer_serve.ray_serve.router`: which replica.
- :mod:`~ninfer_serve.ray_serve.deploy`: the application, its scaling and resources.
- :mod:`~ninfer_serve.ray_serve.driver`: deploying it from a command and serving until stopped.

Needs Ray Serve (``pip install 'ninfer-serve[ray]'``); importing this package without it raises an
ImportError saying so. Nothing outside this package imports Ray.
"""

from __future__ import annotations

try:
    import ray  # noqa: F401
    from ray import serve  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ninfer_serve.ray_serve needs Ray Serve, which is not installed: "
                      "pip install 'ninfer-serve[ray]' (or: pip install 'ray[serve]')") from exc

from ninfer_serve.ray_serve.deploy import APP_NAME, ScaleOut, build_application, run_application
from ninfer_serve.ray_serve.driver import serve_until_stopped
from ninfer_serve.ray_serve.replica import ReplicaSpec

__all__ = ["APP_NAME", "ReplicaSpec", "ScaleOut", "build_application", "run_application", "serve_until_stopped"]
