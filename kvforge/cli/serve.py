"""kvforge serve [MODEL]: the OpenAI-compatible HTTP server (FastAPI + uvicorn, one engine loop thread).

The port is taken before the model loads, so a busy port fails at once.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading

from kvforge.cli.common import add_engine_options, engine_kwargs
from kvforge.cli.startup import (
    add_chat_template_option,
    apply_chat_template,
    budget_note,
    length_note,
    say_loading,
    template_note,
)
from kvforge.errors import ConfigError

API_KEY_ENV = "KVFORGE_API_KEY"


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API", description=__doc__)
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="GGUF file or Hugging Face directory, as in `vllm serve MODEL` (default: --model, "
                        "else the embedded SmolLM2-135M)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require 'Authorization: Bearer KEY'; repeat for several keys (tenants) (default: the "
                        f"{API_KEY_ENV} environment variable if set, as vLLM's VLLM_API_KEY; else no key)")
    p.add_argument("--share-prefix-cache-across-keys", action="store_true",
                   help="let requests of different API keys share prefix-cache blocks (default: isolated per key)")
    p.add_argument("--max-waiting", type=int, default=512,
                   help="requests allowed to wait for a slot before new ones get 429 (0 = unlimited)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body accepted (413 beyond)")
    p.add_argument("--max-tokens-limit", type=int, default=32768,
                   help="most tokens one choice may generate; also the default when a request gives no max_tokens")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: file name)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    add_engine_options(p)
    add_chat_template_option(p)
    g = p.add_argument_group("Ray Serve (pip install 'kvforge[ray]')")
    g.add_argument("--ray", action="store_true", help="serve with many engine replicas on Ray Serve")
    scale = g.add_mutually_exclusive_group()
    scale.add_argument("--num-replicas", type=int, default=None, help="engine replicas (default: 2)")
    scale.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                       help="let Ray Serve scale between MIN and MAX replicas (default: off, a fixed --num-replicas)")
    g.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local Ray)")
    g.add_argument("--routing", default="prefix", choices=["prefix", "pow2"],
                   help="replica choice: prefix-cache affinity, or Ray's power of two choices (default: prefix)")
    g.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs Ray reserves for each replica")
    p.set_defaults(func=run)


def bind(host: str, port: int) -> socket.socket:
    """Take the port now (as uvicorn would), or say who cannot have it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}; stop what uses the port or pick another "
                          "with --port") from None
    return sock


def startup_lines(engine, model_name: str, url: str) -> list[str]:
    s = engine.stats()
    per_token = engine.kv.block_bytes / engine.kv.block_size
    cfg = engine.config
    return [
        f"model: {model_name} ({engine.loaded.path}), {length_note(engine)}, device {engine.device}",
        f"{template_note(engine.tokenizer)}; {sampling_note(engine)}",
        (f"KV cache: {s['kv_cache_dtype']} ({per_token:,.0f} bytes/token), {cfg.kv_layout} layout, "
         f"{s['kv_blocks_total']:,} blocks of {s['kv_block_size']} tokens = {s['kv_bytes_total'] / 2**20:,.1f} MiB "
         f"({s['kv_blocks_total'] * s['kv_block_size']:,} tokens), policy {engine.policy.name}, "
         f"prefix caching {'on' if engine.kv.prefix_tree is not None else 'off'}"),
        budget_note(engine),
        structured_note(),
        f"serving the OpenAI API at {url}/v1 (max_num_seqs {engine.max_num_seqs})",
    ] + tier_lines(engine)


def structured_note() -> str:
    """Whether response_format json / tools can be served: they need llguidance."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"structured output (response_format json_object / json_schema, tools): on, llguidance {version('llguidance')}"
    except PackageNotFoundError:
        return ("structured output (response_format json_object / json_schema, tools): off, such requests get a 400; "
                "pip install 'kvforge[structured]' (llguidance) to serve them")


def sampling_note(engine) -> str:
    from kvforge.models.recommended_sampling import recommended_sampling

    recommended = recommended_sampling(engine.loaded.path)
    if not recommended:
        return "requests without sampling fields get the OpenAI API's defaults (the model recommends none)"
    return f"requests without sampling fields get {recommended.describe()}"


def tier_lines(engine) -> list[str]:
    if engine.tiers is None:
        return []
    chain = engine.tiers
    modes = [f"{t.name} ({'write-through' if w else 'write-back'})" for t, w in zip(chain.tiers, chain.write_through)]
    return [(f"KV tiers: {', '.join(modes)}; a clean stop (SIGTERM, Ctrl-C) writes cached blocks to disk and redis "
             "tiers, a crash keeps what write-through stored")]


def run(args) -> int:
    from kvforge.config import EngineConfig
    from kvforge.engine.engine import LLMEngine
    from kvforge.server import build_app
    from kvforge.server.app import _model_name as model_name

    if args.max_waiting < 0:
        raise ConfigError(f"--max-waiting must be >= 0 (0 = unlimited), got {args.max_waiting}")
    args.api_key = api_keys(args.api_key)
    if any(not k for k in args.api_key):
        raise ConfigError("--api-key must not be empty")
    for flag, value in (("--max-body-bytes", args.max_body_bytes), ("--max-tokens-limit", args.max_tokens_limit)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if args.model_path and args.model and args.model_path != args.model:
        raise ConfigError(f"two models given: {args.model_path!r} and --model {args.model!r}; give one")
    args.model = args.model_path or args.model
    if args.ray:
        return run_on_ray(args)
    sock = bind(args.host, args.port)
    app = None
    try:
        say_loading(args.model)
        engine = LLMEngine(EngineConfig(**engine_kwargs(args)))
        apply_chat_template(engine.tokenizer, args.chat_template, engine.model_config.eos_token_ids)
        config = server_config(args)
        name = args.served_model_name or model_name(engine)
        for line in startup_lines(engine, name, f"http://{args.host}:{args.port}"):
            print(f"kvforge: {line}", file=sys.stderr, flush=True)
        app = build_app(engine, config)
        return serve_app(app, sockets=[sock], log_level=args.log_level)
    finally:
        sock.close()
        if app is not None:
            close_engine(app)


def api_keys(given: list[str]) -> list[str]:
    """--api-key values, else the KVFORGE_API_KEY environment variable (as vLLM reads VLLM_API_KEY), else none."""
    return given or ([os.environ[API_KEY_ENV]] if os.environ.get(API_KEY_ENV) else [])


def close_engine(app) -> None:
    """After uvicorn's shutdown (SIGTERM, Ctrl-C): keep the KV cache in the KV tiers for the next process, unless
    the engine loop thread still holds the engine."""
    loop = app.state.engine_loop
    if not loop.stopped:
        print("kvforge: the engine loop did not stop; KV tiers were not flushed", file=sys.stderr, flush=True)
        return
    engine = loop.engine
    engine.close()
    if engine.tiers is not None:
        s = engine.stats()
        print(f"kvforge: KV tiers closed: {s['tier_close_queued_blocks']} cached blocks written at shutdown, "
              f"{s['tier_close_unwritten_blocks']} left unwritten", file=sys.stderr, flush=True)


def server_config(args):
    from kvforge.server import ServerConfig
    from kvforge.server.limits import RequestLimits

    limits = RequestLimits(max_body_bytes=args.max_body_bytes, max_tokens=args.max_tokens_limit)
    return ServerConfig(api_keys=list(args.api_key), share_prefix_cache_across_keys=args.share_prefix_cache_across_keys,
                        max_waiting=args.max_waiting or None, served_model_name=args.served_model_name, limits=limits)


def run_on_ray(args) -> int:
    """The same server, one engine per Ray Serve replica, with every engine option passed to each replica."""
    from kvforge.serve_ray import require_ray

    require_ray()
    if args.chat_template:
        raise ConfigError("--chat-template does not reach Ray replicas yet; serve without --ray, or use a model that "
                          "ships its template")
    from kvforge.serve_ray.launcher import RayDeployment, parse_autoscale, serve_forever

    d = RayDeployment(engine_kwargs(args), server_config(args), num_replicas=args.num_replicas or 2,
                      autoscale=parse_autoscale(args.autoscale) if args.autoscale else None, routing=args.routing,
                      cpus_per_replica=args.cpus_per_replica)
    return serve_forever(d, args.host, args.port, args.ray_address)


def serve_app(app, sockets=None, **uvicorn_options) -> int:
    """Run app under uvicorn until it is stopped (0) or its engine loop dies (1, so a supervisor restarts it)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, timeout_graceful_shutdown=5, **uvicorn_options))
    loop = app.state.engine_loop

    def exit_on_death(error: BaseException) -> None:
        server.should_exit = True

    loop.on_death = exit_on_death
    previous = signal.signal(signal.SIGTERM, _terminated) if threading.current_thread() is threading.main_thread() else None
    try:
        server.run(sockets=sockets)
    except (KeyboardInterrupt, Terminated):  # uvicorn re-raises the Ctrl-C or SIGTERM it shut down on
        pass
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 1 if loop.error is not None else 0


class Terminated(Exception):
    """SIGTERM, after uvicorn's graceful shutdown: the caller still closes the engine (its default action would
    end the process at once)."""


def _terminated(signum, frame) -> None:
    raise Terminated()
