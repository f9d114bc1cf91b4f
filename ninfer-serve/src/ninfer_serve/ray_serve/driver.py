"""Running the application from a command: join or start a cluster, deploy, serve until a stop signal.

Used by ``ninfer serve --ray`` (:mod:`ninfer_serve.cli_ray`). The calling process is a Ray driver; the
HTTP listener is Ray Serve's proxy, not this process. A stop signal (SIGINT/SIGTERM) while deploying
interrupts the deployment (which waits for as long as the cluster lacks the replicas' resources); after
it, it ends the serving. Either way the application is deleted and the driver disconnects, which also
stops a local cluster ``ray.init`` started for it (a cluster started with ``ray start`` keeps running).
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
from collections.abc import Callable, Iterator

import ray
from ray import serve

from ninfer_serve.ray_serve.deploy import APP_NAME, ScaleOut, build_application, run_application
from ninfer_serve.ray_serve.replica import ReplicaSpec


def with_cluster_gpus(scale: ScaleOut, spec: ReplicaSpec, cluster_gpus: float) -> ScaleOut:
    """``scale`` with ``num_gpus`` decided when it was left to the cluster (``None``): one GPU per replica when
    the cluster has GPUs and the engine is not told to run on the CPU, else none."""
    if scale.num_gpus is not None:
        return scale
    on_cpu = getattr(spec.engine_options, "device", None) == "cpu"
    return dataclasses.replace(scale, num_gpus=1.0 if cluster_gpus >= 1 and not on_cpu else 0.0)


def serve_until_stopped(spec: ReplicaSpec, scale: ScaleOut, *, host: str, port: int, ray_address: str | None,
                        on_ready: Callable[[ScaleOut], None], on_stopping: Callable[[], None]) -> None:
    """Deploy on the cluster at ``ray_address`` (``None``: ``$RAY_ADDRESS``, else one ``ray start`` runs on this
    machine, else a new local one; ``"local"``: always a new local one) and serve on ``host:port`` until
    SIGINT/SIGTERM. ``on_ready(scale)`` runs once every replica is up (``scale`` with its GPUs decided),
    ``on_stopping()`` once a stop signal came after that."""
    stop = threading.Event()
    ray.init(address=ray_address, logging_level="WARNING")
    try:
        scale = with_cluster_gpus(scale, spec, ray.cluster_resources().get("GPU", 0))
        with _on_stop_signal(_interrupt):
            try:
                run_application(build_application(spec, scale), host=host, port=port)
            except KeyboardInterrupt:
                stop.set()
        with _on_stop_signal(lambda *_: stop.set()):
            if not stop.is_set():
                on_ready(scale)
                # Timed waits, so the main thread runs the SIGTERM/SIGINT handler that sets ``stop``.
                while not stop.wait(0.5):
                    continue
                on_stopping()
            serve.delete(APP_NAME)
    finally:
        ray.shutdown()


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _on_stop_signal(handler: Callable[..., None]) -> Iterator[None]:
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
