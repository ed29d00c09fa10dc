"""`kvforge bench kv-policies`: decode speed with a KV policy active against the full cache, same context, one run."""
from __future__ import annotations

from kvforge.cli.bench_output import emit, output_options


def _budget(text: str) -> float | int:
    value = float(text)
    return value if value < 1 else int(value)


def register_policies(bsub) -> None:
    p = bsub.add_parser("kv-policies", help="decode tok/s with each KV policy active vs the full cache at the same "
                                            "context (ratios from one run, rounds alternating)")
    p.add_argument("--policies", nargs="+", default=None,
                   help="policies to time (default: keydiff kvzip tova expected_attention)")
    p.add_argument("--budget", type=_budget, default=0.5,
                   help="what each policy keeps: a fraction of the sequence (< 1) or a token count (default: 0.5)")
    p.add_argument("--seq-len", type=int, default=1024, help="prompt tokens per sequence (the context)")
    p.add_argument("--batch", type=int, default=2, help="sequences decoded together")
    p.add_argument("--steps", type=int, default=16, help="decode steps per engine per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, every engine once per round (medians)")
    p.add_argument("--kv-dtype", default="fp32", help="KV format of every engine (default: fp32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    output_options(p, model=True)
    p.set_defaults(func=run_kv_policies)


def run_kv_policies(args) -> int:
    from kvforge.bench.kv_policies import kv_policies_bench
    from kvforge.models.loader import load_model

    r = kv_policies_bench(load_model(args.model), args.policies, args.budget, args.seq_len, args.batch, args.steps,
                          args.rounds, args.seed, args.kv_dtype, progress=not args.no_progress)
    if args.json:
        emit(r, True, [])
        return 0
    print(f"{r['context']}-token prompts, batch {r['batch']}, budget {r['budget']}, {r['kv_dtype']} cache, "
          f"medians of {r['rounds']} rounds x {r['steps']} steps, {r['threads']} thread(s)")
    print(f"{'policy':<20} {'decode tok/s':>13} {'vs full':>8} {'CPU vs full':>12} {'cache tokens':>13} "
          f"{'steps recording attention':>26}")
    for label, row in r["policies"].items():
        cached = "/".join(str(n) for n in row["cache_tokens"])
        print(f"{label:<20} {row['decode_tok_s']:>13.1f} {row['speed_vs_full']:>7.2f}x {row['cpu_speed_vs_full']:>11.2f}x "
              f"{cached:>13} {row['decode_steps_recording_attention']:>15} of {row['decode_steps_timed']}")
    return 0
