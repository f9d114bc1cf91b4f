"""The Ray Serve application: the ingress deployment in front of the engine replica deployment.

:func:`build_application` binds the two; :func:`run_application` starts Ray Serve's HTTP proxy and deploys
it. Deployment settings come from :class:`ScaleOut`:

- Replicas: a fixed count (``min_replicas == max_replicas``) or Ray Serve autoscaling between the bounds,
  aiming at ``target_ongoing_requests`` in flight per replica.
- Resources: each replica asks Ray for ``num_gpus`` (1 on a GPU cluster: one engine per GPU) and
  ``num_cpus``; Ray places replicas on whichever nodes have them, across a multi-node cluster.
- ``max_ongoing_requests``: what Ray sends one replica at once, by default the engine's running plus queued
  capacity, so the engine's own queue (and its 429) stays the admission control; the router spills an
  affine request to another replica only when its own is full.
- One ingress replica by default: the affinity table and the response owners live in it, so a second
  ingress (``ingress_replicas``) would keep its own tables and split sessions between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.config import HTTPOptions, RequestRouterConfig

from ninfer_serve.ray_serve.ingress import IngressApp
from ninfer_serve.ray_serve.replica import EngineReplica, ReplicaSpec
from ninfer_serve.ray_serve.router import DEFAULT_TABLE_SIZE, AffinityRouter

APP_NAME = "ninfer"
ENGINE_DEPLOYMENT = "NInferEngine"
INGRESS_DEPLOYMENT = "NInferIngress"


@dataclass(frozen=True)
class ScaleOut:
    """How the engine replicas scale and what each one asks of the cluster. Invariants (checked by
    :meth:`validate`): ``1 <= min_replicas <= max_replicas``; ``initial_replicas``, when given, within them;
    ``target_ongoing_requests > 0``; ``num_gpus``, ``num_cpus`` >= 0 (``num_gpus`` ``None``: decided by
    :func:`ninfer_serve.ray_serve.driver.with_cluster_gpus` from the cluster, before building); ``max_ongoing_requests >= 1`` when
    given (``None``: the engine's ``max_concurrency + queue_capacity``); table sizes >= 1. ``log_level``: Ray
    Serve's log level for both deployments (``ninfer serve --log-level``)."""

    min_replicas: int = 1
    max_replicas: int = 1
    initial_replicas: int | None = None
    target_ongoing_requests: float = 2.0
    num_gpus: float | None = 0.0
    num_cpus: float = 1.0
    max_ongoing_requests: int | None = None
    ingress_replicas: int = 1
    affinity_table_size: int = DEFAULT_TABLE_SIZE
    response_owners: int = 65536
    health_check_period_s: float = 10.0
    graceful_shutdown_timeout_s: float = 30.0
    log_level: str = "INFO"

    def validate(self) -> ScaleOut:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"replicas: need 1 <= min ({self.min_replicas}) <= max ({self.max_replicas})")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial replicas {self.initial_replicas} is outside {self.min_replicas}.."
                             f"{self.max_replicas}")
        if not self.target_ongoing_requests > 0:
            raise ValueError(f"target ongoing requests must be > 0, got {self.target_ongoing_requests}")
        if (self.num_gpus is not None and self.num_gpus < 0) or self.num_cpus < 0:
            raise ValueError(f"per-replica resources must be >= 0, got {self.num_gpus} GPUs, {self.num_cpus} CPUs")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise ValueError(f"max ongoing requests must be >= 1, got {self.max_ongoing_requests}")
        if self.ingress_replicas < 1 or self.affinity_table_size < 1 or self.response_owners < 1:
            raise ValueError("ingress replicas and table sizes must be >= 1")
        return self

    def replica_count(self) -> dict[str, Any]:
        """The deployment's ``num_replicas`` or ``autoscaling_config``."""
        if self.min_replicas == self.max_replicas:
            return {"num_replicas": self.min_replicas}
        auto = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests}
        if self.initial_replicas is not None:
            auto["initial_replicas"] = self.initial_replicas
        return {"autoscaling_config": auto}


class Ingress:
    """The ingress deployment class: hosts :class:`IngressApp` over a handle to the engine replicas."""

    def __init__(self, replicas: Any, max_body_bytes: int, response_owners: int) -> None:
        self._app = IngressApp(replicas, max_body_bytes=max_body_bytes, response_owners=response_owners)

    def __serve_build_asgi_app__(self) -> IngressApp:
        return self._app


def _engine_capacity(options: Any) -> int:
    return int(options.max_concurrency) + int(options.queue_capacity)


def build_application(spec: ReplicaSpec, scale: ScaleOut) -> Any:
    """The bound Ray Serve application (pass it to ``serve.run``)."""
    scale.validate()
    if scale.num_gpus is None:
        raise ValueError("ScaleOut.num_gpus is None: decide it from the cluster first (driver.with_cluster_gpus)")
    max_ongoing = scale.max_ongoing_requests or _engine_capacity(spec.engine_options)
    logging = {"log_level": scale.log_level.upper()}
    engine = serve.deployment(
        EngineReplica, name=ENGINE_DEPLOYMENT, logging_config=logging,
        ray_actor_options={"num_gpus": scale.num_gpus, "num_cpus": scale.num_cpus},
        max_ongoing_requests=max_ongoing,
        # Ray queues requests the replicas have no room for; the engine's own queue answers 429 before that.
        max_queued_requests=-1,
        health_check_period_s=scale.health_check_period_s,
        graceful_shutdown_timeout_s=scale.graceful_shutdown_timeout_s,
        request_router_config=RequestRouterConfig(request_router_class=AffinityRouter,
                                                  request_router_kwargs={"table_size": scale.affinity_table_size}),
        **scale.replica_count(),
    )
    ingress = serve.deployment(
        serve.ingress()(Ingress), name=INGRESS_DEPLOYMENT, num_replicas=scale.ingress_replicas,
        logging_config=logging,
        # The proxy does no model work: it must not take a CPU a replica could use.
        ray_actor_options={"num_cpus": 0},
        # Streams are long-lived and cheap to relay; the engines bound the real concurrency.
        max_ongoing_requests=max(1000, 4 * max_ongoing * scale.max_replicas),
    )
    return ingress.bind(engine.bind(spec), spec.config.max_body_bytes, scale.response_owners)


def run_application(app: Any, *, host: str, port: int, name: str = APP_NAME) -> None:
    """Start Ray Serve's HTTP proxy on ``host:port`` (on every node of the cluster) and deploy ``app`` at
    ``/``; returns once every replica is running. Ray must be initialised (``ray.init``) by the caller."""
    serve.start(http_options=HTTPOptions(host=host, port=port))
    serve.run(app, name=name, route_prefix="/", blocking=False)
