"""`kvforge eval retrieval`: the command line of kvforge/eval/retrieval.py."""
from __future__ import annotations

import json
import sys

from kvforge.cli.common import add_policy_options, policy_kwargs
from kvforge.eval.panel import parse_variant
from kvforge.eval.passkey import technique_label
from kvforge.eval.retrieval import DEFAULT_LENGTHS, format_retrieval, retrieval_eval
from kvforge.eval.retrieval_tasks import TASKS
from kvforge.progress import default_enabled


def register_retrieval(esub) -> None:
    p = esub.add_parser("retrieval", help="RULER-style retrieval (needles, variables, common words): several questions "
                                          "after one compressed context, exact match, full cache as the ceiling")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--kv-dtype", "--kv-cache-dtype", dest="kv_dtype", default="fp32", help="KV storage format")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of: {', '.join(TASKS)} (default: all)")
    p.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                   help="comma-separated context lengths in tokens (default: 1024,2048; 4096 fits SmolLM2's context)")
    p.add_argument("--contexts", type=int, default=2, help="generated contexts per task and length (default: 2)")
    p.add_argument("--questions", type=int, default=4, help="needles asked per context in niah_multikey (default: 4)")
    p.add_argument("--chunk-size", type=int, default=64, help="tokens per forward; policies compact between chunks")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated cases (default: 0)")
    p.add_argument("--variant", action="append", default=[], metavar="SPEC",
                   help="also score FORMAT[+POLICY:BUDGET[:OPTIONS]] on the same cases, e.g. 'fp32+keydiff:0.5' "
                        "(repeatable; beside --kv-policy / --kv-dtype)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (default: bars when stderr is a terminal)")
    add_policy_options(p)
    p.set_defaults(func=run_retrieval)


def run_retrieval(args) -> int:
    from kvforge.errors import ConfigError
    from kvforge.models.loader import load_model

    tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ConfigError(f"--tasks: unknown {', '.join(unknown) or '(none given)'}; allowed: {', '.join(TASKS)}")
    try:
        lengths = tuple(int(n) for n in args.lengths.split(","))
    except ValueError:
        raise ConfigError(f"--lengths must be comma-separated token counts, got {args.lengths!r}") from None
    if min(lengths) < 256 or args.contexts < 1 or args.questions < 1 or args.chunk_size < 1:
        raise ConfigError("--lengths must be >= 256 tokens, --contexts, --questions and --chunk-size >= 1")
    loaded = load_model(args.model)
    if max(lengths) > loaded.config.max_position_embeddings:
        raise ConfigError(f"--lengths: {max(lengths)} tokens exceed the model's context of "
                          f"{loaded.config.max_position_embeddings}")
    variants = {v.label: v.options for v in map(parse_variant, args.variant)}
    if args.kv_policy or args.kv_dtype != "fp32":
        variants[technique_label(args.kv_dtype, args.kv_policy, args.budget)] = {"kv_cache_dtype": args.kv_dtype,
                                                                                 **policy_kwargs(args)}
    r = retrieval_eval(loaded, tasks, lengths, args.contexts, args.questions, args.chunk_size, args.seed, variants,
                       progress=not args.no_progress and default_enabled(),
                       log=lambda m: print(m, file=sys.stderr, flush=True))  # one line per technique, on stderr
    if args.json:
        json.dump(r, sys.stdout, indent=2)
        print()
        return 0
    print(format_retrieval(r))
    return 0
