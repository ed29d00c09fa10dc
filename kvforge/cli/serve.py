"""kvforge serve: the OpenAI-compatible HTTP server (FastAPI + uvicorn, one engine loop thread)."""
from __future__ import annotations

from kvforge.cli.common import add_engine_options, engine_kwargs


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require 'Authorization: Bearer KEY'; repeat for several keys (tenants)")
    p.add_argument("--share-prefix-cache-across-keys", action="store_true",
                   help="let requests of different API keys share prefix-cache blocks (default: isolated per key)")
    p.add_argument("--max-waiting", type=int, default=512,
                   help="requests allowed to wait for a slot before new ones get 429 (0 = unlimited)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body accepted (400 beyond)")
    p.add_argument("--max-tokens-limit", type=int, default=32768,
                   help="most tokens one choice may generate; also the default when a request gives no max_tokens")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: file name)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_options(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from kvforge.config import EngineConfig
    from kvforge.engine.engine import LLMEngine
    from kvforge.errors import ConfigError
    from kvforge.server import ServerConfig, build_app
    from kvforge.server.limits import RequestLimits

    if args.max_waiting < 0:
        raise ConfigError(f"--max-waiting must be >= 0 (0 = unlimited), got {args.max_waiting}")
    if any(not k for k in args.api_key):
        raise ConfigError("--api-key must not be empty")
    for flag, value in (("--max-body-bytes", args.max_body_bytes), ("--max-tokens-limit", args.max_tokens_limit)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    engine = LLMEngine(EngineConfig(**engine_kwargs(args)))
    limits = RequestLimits(max_body_bytes=args.max_body_bytes, max_tokens=args.max_tokens_limit)
    config = ServerConfig(api_keys=list(args.api_key), share_prefix_cache_across_keys=args.share_prefix_cache_across_keys,
                          max_waiting=args.max_waiting or None, served_model_name=args.served_model_name, limits=limits)
    return serve_app(build_app(engine, config), host=args.host, port=args.port, log_level=args.log_level)


def serve_app(app, sockets=None, **uvicorn_options) -> int:
    """Run app under uvicorn until it is stopped (0) or its engine loop dies (1, so a supervisor restarts it)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, timeout_graceful_shutdown=5, **uvicorn_options))
    loop = app.state.engine_loop

    def exit_on_death(error: BaseException) -> None:
        server.should_exit = True

    loop.on_death = exit_on_death
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on
        pass
    return 1 if loop.error is not None else 0
