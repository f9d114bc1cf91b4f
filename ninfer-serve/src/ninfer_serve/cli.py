"""``ninfer serve``: the OpenAI- and Anthropic-compatible HTTP server, as a ``ninfer`` subcommand.

Registered through the ``ninfer_cli_commands`` hook (:mod:`ninfer_serve.plugin`). The arguments are declared
for every ``ninfer`` invocation, so the HTTP stack (litestar, uvicorn) is imported only when the command runs.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from ninfer.cli import common
from ninfer.cli.command import CliCommand
from ninfer.errors import NInferError


def add_arguments(p) -> None:
    # --warmup/--no-warmup (the engine flags) also governs the warm-up request below.
    common.add_model_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    g.add_argument("--model-id", default=None,
                   help="public model name clients send (default: the artifact's metadata.name)")
    g.add_argument("--api-key", default=os.environ.get("NINFER_API_KEY"),
                   help="require this key (Authorization: Bearer or x-api-key) on every endpoint but /health and the "
                        "chat page's files, /metrics included; default $NINFER_API_KEY")
    g.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve without --api-key on a --host other than a loopback address (refused otherwise)")
    g.add_argument("--queue-capacity", type=int, default=None, metavar="N",
                   help="requests that may wait beyond --max-concurrency before new ones get 429 (default 64)")
    g.add_argument("--queue-timeout", type=float, default=None, metavar="SECONDS",
                   help="a request waiting longer than this for a slot gets 429 (default: no limit)")
    g.add_argument("--keepalive", type=float, default=5.0, metavar="SECONDS",
                   help="send an SSE keep-alive after this much idle time (default 5)")
    g.add_argument("--max-body-mib", type=float, default=32.0,
                   help="largest request body; larger ones get 413 (default 32 MiB)")
    g.add_argument("--max-header-kib", type=float, default=16.0,
                   help="largest request headers, all together; larger ones get 431 (default 16 KiB)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long in-flight requests may finish after SIGTERM (default 30)")
    g.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="turn CORS on for these browser origins, comma-separated (e.g. http://localhost:3000, "
                        "or * for any); off when not given")
    g.add_argument("--responses-store-size", type=int, default=256, metavar="N",
                   help="keep the last N stored /v1/responses results in memory for previous_response_id and "
                        "GET /v1/responses/{id} (default 256; 0 keeps none)")
    g.add_argument("--allowed-media-path", action="append", default=[], metavar="DIR",
                   help="let image and video parts name local files (a path or file:// URL) inside DIR, after "
                        "following symlinks; repeatable (default: no local files, only data: URLs)")
    g.add_argument("--allow-remote-media", action="store_true",
                   help="let image and video parts name http(s) URLs; the server fetches them itself and refuses "
                        "loopback, private, link-local and other non-public addresses (default: off)")
    g.add_argument("--max-media-mib", type=float, default=20.0,
                   help="largest image or video a request may carry or name, encoded (default 20 MiB)")
    g.add_argument("--no-ui", dest="ui", action="store_false",
                   help="do not serve the chat page at / (API-only deployments; / answers 404)")
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="server log level; at info and debug every request gets an access-log line (default info)")
    from ninfer_serve.cli_ray import add_ray_arguments

    add_ray_arguments(p)


def allowed_origins(raw: str | None) -> tuple[str, ...]:
    """``--allowed-origins``: ``*`` or comma-separated ``scheme://host[:port]`` origins; anything else is an
    error naming the value."""
    if raw is None:
        return ()
    origins = tuple(part.strip() for part in raw.split(",") if part.strip())
    bad = [o for o in origins if o != "*" and (not o.startswith(("http://", "https://")) or o.rstrip("/") != o
                                              or "/" in o.split("://", 1)[1])]
    if not origins or bad:
        raise NInferError(f"--allowed-origins {raw!r}: expected '*' or comma-separated origins like "
                          f"http://localhost:3000 (scheme and host, no path)")
    return origins


def _url_host(host: str) -> str:
    """A host as it goes in a URL a person can open: an IPv6 address bracketed, a wildcard address as localhost."""
    if host in ("0.0.0.0", "::", ""):
        return "localhost"
    return f"[{host}]" if ":" in host else host


def _positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise NInferError(f"--{name} must be > 0, got {value}")


def run(args) -> int:
    if not 0 < args.port < 65536:
        raise NInferError(f"--port must be in 1..65535, got {args.port}")
    for name in ("keepalive", "max_body_mib", "max_header_kib", "shutdown_timeout", "queue_timeout"):
        _positive(name.replace("_", "-"), getattr(args, name))
    if args.responses_store_size < 0:
        raise NInferError(f"--responses-store-size must be >= 0, got {args.responses_store_size}")
    if args.api_key is not None and not args.api_key.strip():
        raise NInferError("--api-key is empty")
    origins = allowed_origins(args.allowed_origins)
    _positive("max-media-mib", args.max_media_mib)
    from ninfer_serve.media_policy import MediaPolicy

    try:
        media = MediaPolicy.of(args.allowed_media_path, args.allow_remote_media,
                               max_bytes=int(args.max_media_mib * 2**20))
    except ValueError as exc:
        raise NInferError(str(exc)) from None
    options = common.engine_options(args)
    if args.queue_capacity is not None:
        options = dataclasses.replace(options, queue_capacity=args.queue_capacity)
    if args.queue_timeout is not None:
        options = dataclasses.replace(options, queue_timeout_s=args.queue_timeout)

    from ninfer_serve.cli_ray import check_ray_flags

    if check_ray_flags(args):
        from ninfer_serve.cli_ray import serve_on_ray

        _check_exposure(args)
        return serve_on_ray(args, options, serve_config(args, args.model_id or "", origins, media))

    from ninfer_serve.listen import reserve_address

    # Before anything slow: an address in use fails now, not after the model has loaded.
    sock = reserve_address(args.host, args.port)
    try:
        _check_exposure(args)
        return _serve(args, options, sock, origins, media)
    finally:
        sock.close()


def _check_exposure(args) -> None:
    """Refuse to serve without a key on an address other machines can reach, unless told to."""
    from ninfer_serve.listen import is_loopback

    if args.api_key is not None or is_loopback(args.host):
        return
    if not args.allow_unauthenticated:
        raise NInferError(f"--host {args.host} is reachable from other machines (not a loopback address) and no "
                          f"--api-key (or $NINFER_API_KEY) is set, so anyone who reaches it could use the model: "
                          f"set --api-key, or pass --allow-unauthenticated to serve without a key on purpose")
    print(f"[ninfer] warning: serving without an API key on {args.host} (--allow-unauthenticated): every client "
          f"that reaches it can use every endpoint", file=sys.stderr)


def serve_config(args, model_id: str, origins: tuple[str, ...], media):
    """The ServeConfig the server flags describe (``ninfer serve`` and ``ninfer serve --ray`` alike)."""
    from ninfer_serve.config import ServeConfig

    return ServeConfig(model_id=model_id, api_key=args.api_key, keepalive_s=args.keepalive,
                       max_body_bytes=int(args.max_body_mib * 2**20),
                       max_header_bytes=int(args.max_header_kib * 2**10), allowed_origins=origins,
                       responses_store_size=args.responses_store_size, media=media, ui=args.ui)


def _serve(args, options, sock, origins: tuple[str, ...], media) -> int:
    from ninfer import Engine
    from ninfer.contracts.memory import format_memory_summary
    from ninfer.model_source import resolve_model

    from ninfer_serve.server import serve
    from ninfer_serve.warmup import warm_up

    started = time.monotonic()
    artifact = resolve_model(args.model, progress=not args.quiet and sys.stderr.isatty(), quiet=args.quiet,
                             draft=options.speculative)
    engine = Engine.start(artifact, options)
    try:
        model_id = args.model_id or engine.info.get("name") or artifact.stem
        if not args.quiet:
            print(f"[ninfer] loaded {model_id} in {time.monotonic() - started:.1f} s"
                  f"{common.startup_phases(engine.info.get('startup'))} (max_concurrency "
                  f"{engine.options.max_concurrency}, max_context {engine.max_context})", file=sys.stderr)
            print(format_memory_summary(engine.memory_summary()), file=sys.stderr)
        if args.engine_warmup is not False:  # --no-warmup skips the engine's warm-up and this request
            took = warm_up(engine)
            if not args.quiet:
                print(f"[ninfer] warm-up done in {took:.2f} s", file=sys.stderr)
        config = serve_config(args, model_id, origins, media)

        def ready() -> None:  # the server accepts connections now
            if not args.quiet:
                page = f"; chat page: http://{_url_host(args.host)}:{args.port}/" if args.ui else ""
                print(f"[ninfer] serving {model_id!r} on http://{args.host}:{args.port}{page}", file=sys.stderr,
                      flush=True)

        serve(engine, config, host=args.host, port=args.port, log_level=args.log_level,
              shutdown_timeout_s=args.shutdown_timeout, sock=sock, on_ready=ready)
    finally:
        engine.close()
    return 0


COMMAND = CliCommand(
    name="serve", help="serve a model over HTTP (OpenAI and Anthropic APIs)", add_arguments=add_arguments, run=run,
    description="Serve one model over HTTP: OpenAI Chat Completions / Completions / Responses / Models, Anthropic Messages, "
                "/tokenize, /health and Prometheus /metrics; with --ray, over engine replicas on a Ray cluster "
                "(docs/scale-out.md).")
