"""``ninfer serve --ray``: the same server, scaled out over engine replicas on a Ray cluster
(docs/scale-out.md).

The flags are declared with ``ninfer serve``'s (no Ray import until the command runs). With ``--ray`` this
process is a Ray driver: it resolves the model once (so a first-run conversion happens here, not in every
replica at once), joins or starts the cluster, deploys :mod:`ninfer_serve.ray_serve`'s application with
Ray Serve's HTTP proxy on ``--host:--port``, and waits for SIGINT/SIGTERM; then it deletes the
application (the cluster itself is left running when it was not started by this command).
"""

from __future__ import annotations

import sys
import time

from ninfer.errors import NInferError

_RAY_ONLY = ("ray_address", "replicas", "min_replicas", "max_replicas", "target_ongoing_requests",
             "gpus_per_replica", "cpus_per_replica")


def add_ray_arguments(p) -> None:
    g = p.add_argument_group("scale-out on Ray Serve (needs ninfer-serve[ray]; docs/scale-out.md)")
    g.add_argument("--ray", action="store_true",
                   help="serve through Ray Serve: engine replicas behind one ingress, with session affinity")
    g.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="the Ray cluster to deploy on, e.g. HEAD_IP:6379, or `local` for a new one on this machine "
                        "that lives as long as the command (default: $RAY_ADDRESS, else a cluster `ray start` runs "
                        "on this machine, else a new local one)")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="a fixed number of engine replicas (default 1 unless --min/--max-replicas are given)")
    g.add_argument("--min-replicas", type=int, default=None, metavar="N",
                   help="autoscaling: the fewest engine replicas (with --max-replicas)")
    g.add_argument("--max-replicas", type=int, default=None, metavar="N",
                   help="autoscaling: the most engine replicas (with --min-replicas)")
    g.add_argument("--target-ongoing-requests", type=float, default=None, metavar="N",
                   help="autoscaling: requests in flight per replica Ray Serve aims at (default: --max-concurrency)")
    g.add_argument("--gpus-per-replica", type=float, default=None, metavar="G",
                   help="GPUs each replica asks Ray for (default 1 when the cluster has GPUs and --device is not "
                        "cpu, else 0)")
    g.add_argument("--cpus-per-replica", type=float, default=None, metavar="C",
                   help="CPUs each replica asks Ray for (default 1)")


def check_ray_flags(args) -> bool:
    """Whether ``--ray`` is on; a Ray flag without it, or a replica count given two ways, is an error."""
    given = [f for f in _RAY_ONLY if getattr(args, f, None) is not None]
    if not getattr(args, "ray", False):
        if given:
            raise NInferError(f"--{given[0].replace('_', '-')} needs --ray")
        return False
    if args.replicas is not None and (args.min_replicas is not None or args.max_replicas is not None):
        raise NInferError("--replicas is a fixed count: give it, or --min-replicas with --max-replicas, not both")
    if (args.min_replicas is None) != (args.max_replicas is None):
        raise NInferError("autoscaling needs both --min-replicas and --max-replicas")
    return True


def _scale_out(args, options):
    from ninfer_serve.ray_serve import ScaleOut

    low, high = (args.min_replicas, args.max_replicas) if args.min_replicas is not None else \
        (args.replicas or 1,) * 2
    try:
        return ScaleOut(min_replicas=low, max_replicas=high,
                        target_ongoing_requests=args.target_ongoing_requests or float(options.max_concurrency),
                        num_gpus=args.gpus_per_replica,  # None: one per replica when the cluster has GPUs
                        num_cpus=1.0 if args.cpus_per_replica is None else args.cpus_per_replica,
                        graceful_shutdown_timeout_s=args.shutdown_timeout, log_level=args.log_level).validate()
    except ValueError as exc:
        raise NInferError(f"--ray: {exc}") from None


def serve_on_ray(args, options, config) -> int:
    """Deploy and serve until SIGINT/SIGTERM. ``config``: the ServeConfig of the server flags; an empty
    ``model_id`` lets each replica serve the artifact under its metadata name."""
    try:
        from ninfer_serve import ray_serve
    except ImportError as exc:
        if exc.__cause__ is None or getattr(exc.__cause__, "name", "").partition(".")[0] != "ray":
            raise  # not Ray missing: a real error, shown as one
        raise NInferError("--ray needs Ray Serve, which is not installed: pip install 'ninfer-serve[ray]'") from None
    from ninfer.model_source import resolve_model

    scale = _scale_out(args, options)
    artifact = resolve_model(args.model, progress=not args.quiet and sys.stderr.isatty(), quiet=args.quiet,
                             draft=options.speculative)
    spec = ray_serve.ReplicaSpec(model=str(artifact), engine_options=options, config=config,
                                 warmup=args.engine_warmup is not False)
    started = time.monotonic()

    def ready(scale) -> None:
        if args.quiet:
            return
        count = (f"{scale.min_replicas}" if scale.min_replicas == scale.max_replicas
                 else f"{scale.min_replicas}..{scale.max_replicas}")
        print(f"[ninfer] serving {artifact.name} on Ray Serve with {count} engine replica(s) ({scale.num_gpus:g} "
              f"GPU, {scale.num_cpus:g} CPU each), ready in {time.monotonic() - started:.1f} s: "
              f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)

    def stopping() -> None:
        if not args.quiet:
            print("[ninfer] stopping: deleting the application", file=sys.stderr, flush=True)

    ray_serve.serve_until_stopped(spec, scale, host=args.host, port=args.port, ray_address=args.ray_address,
                                  on_ready=ready, on_stopping=stopping)
    return 0
