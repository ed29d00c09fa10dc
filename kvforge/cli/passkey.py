"""`kvforge eval passkey`: the command line of kvforge/eval/passkey.py."""
from __future__ import annotations

import json
import sys

from kvforge.cli.common import add_policy_options, policy_kwargs
from kvforge.eval.passkey import format_passkey, passkey_eval, technique_label
from kvforge.progress import default_enabled


def register_passkey(esub) -> None:
    p = esub.add_parser("passkey", help="recall a number hidden in long filler text, by KV policy and depth")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--kv-dtype", "--kv-cache-dtype", dest="kv_dtype", default="fp32", help="KV storage format")
    p.add_argument("--length", type=int, default=2048, help="prompt length in tokens")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="comma-separated needle depths in [0, 1]")
    p.add_argument("--trials", type=int, default=2, help="keys per depth")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (default: bars when stderr is a terminal)")
    add_policy_options(p)
    p.set_defaults(func=run_passkey)


def run_passkey(args) -> int:
    from kvforge.errors import ConfigError
    from kvforge.models.loader import load_model

    try:
        depths = tuple(float(d) for d in args.depths.split(","))
    except ValueError:
        raise ConfigError(f"--depths must be comma-separated numbers in [0, 1], got {args.depths!r}") from None
    if not all(0 <= d <= 1 for d in depths) or args.trials < 1 or args.length < 64:
        raise ConfigError("--depths must lie in [0, 1], --trials >= 1 and --length >= 64")
    if args.kv_dtype == "fp32" and not args.kv_policy:
        raise ConfigError("nothing to compare with the baseline (fp32 cache, no eviction): give the technique, e.g. "
                          "--kv-policy streaming --budget 1024, --kv-policy h2o --budget 0.5, or --kv-dtype int4")
    loaded = load_model(args.model)
    r = passkey_eval(loaded, args.length, depths, args.trials, progress=not args.no_progress and default_enabled(),
                     kv_cache_dtype=args.kv_dtype, **policy_kwargs(args))
    if args.json:
        json.dump(r, sys.stdout, indent=2)
        print()
        return 0
    print(format_passkey(r, technique_label(args.kv_dtype, args.kv_policy, args.budget)))
    return 0
