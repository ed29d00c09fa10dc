"""`kvforge calibrate heads`: find the model's retrieval and streaming heads, stored beside the model for policies."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="measure something about a model once and store it for later runs")
    csub = p.add_subparsers(dest="calibrate_command", metavar="WHAT", required=True)
    h = csub.add_parser("heads", help="score each KV head as retrieval or streaming (DuoAttention's split), for the "
                                      "kv_policy option heads='auto'",
                        description="Hide a needle of random tokens in generated filler, give it again and score each "
                                    "KV head by the attention it puts on the token it copies next (no download). The "
                                    "scores go to $XDG_CACHE_HOME/kvforge/heads/<model id>.json (default ~/.cache), "
                                    "keyed by the model file's identity; kv_policy_options {\"heads\": \"auto\"} "
                                    "reads it (per-head policies: h2o, scissorhands, keydiff, expected_attention, kvzip).")
    h.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2-135M)")
    h.add_argument("--context", type=int, default=1024, help="filler tokens before the copy (default 1024)")
    h.add_argument("--needle", type=int, default=24, help="needle tokens copied (default 24)")
    h.add_argument("--trials", type=int, default=4, help="generated contexts averaged (default 4)")
    h.add_argument("--seed", type=int, default=0, help="seed of the generated contexts (default 0)")
    h.add_argument("--output", default=None, help="write here (default: the user cache, keyed by the model file)")
    h.add_argument("--json", action="store_true", help="print the stored JSON")
    h.set_defaults(func=run_heads)


def run_heads(args) -> int:
    from kvforge.eval.head_calibration import CalibrationConfig, calibrate_heads
    from kvforge.kv.policies.head_roles import heads_path
    from kvforge.models.loader import load_model

    cfg = CalibrationConfig(args.context, args.needle, args.trials, args.seed)
    loaded = load_model(args.model)
    if cfg.context + cfg.needle > loaded.config.max_position_embeddings:
        from kvforge.errors import ConfigError

        raise ConfigError(f"--context: {cfg.context} + {cfg.needle} tokens exceed the model's context of "
                          f"{loaded.config.max_position_embeddings}")
    scores = calibrate_heads(loaded, cfg)
    path = scores.save(Path(args.output) if args.output else heads_path(loaded.path))
    if args.json:
        json.dump(scores.to_json(), sys.stdout, indent=1)
        print()
        return 0
    roles = scores.roles(0.25, 0.5)
    top = scores.scores.flatten().argsort(descending=True)[:5].tolist()
    heads = scores.scores.shape[1]
    print(f"{scores.scores.shape[0]} layers x {heads} KV heads scored ({cfg.trials} contexts of {cfg.context} tokens, "
          f"needle {cfg.needle}); stored at {path}")
    print("strongest retrieval heads (layer.head score): " +
          ", ".join(f"{i // heads}.{i % heads} {float(scores.scores.flatten()[i]):.3f}" for i in top))
    print(f"with the default shares: {int(roles.retrieval.sum())} retrieval heads, {int(roles.streaming.sum())} "
          "streaming heads; use kv_policy_options {\"heads\": \"auto\"}")
    return 0
