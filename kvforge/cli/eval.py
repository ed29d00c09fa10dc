"""kvforge eval: quality of KV techniques on real text (perplexity; more evals register here)."""
from __future__ import annotations

import json
import sys

from kvforge.cli.common import add_format_options, add_policy_options, format_kwargs, policy_kwargs
from kvforge.eval.passkey import register_passkey


def register(sub) -> None:
    p = sub.add_parser("eval", help="measure quality of KV techniques on real text")
    esub = p.add_subparsers(dest="eval", required=True)
    ppl = esub.add_parser("ppl", help="decode-faithful perplexity vs the fp32 full cache, in one run")
    ppl.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2-135M)")
    add_format_options(ppl)
    ppl.add_argument("--text", default="hamlet", help="hamlet, macbeth, hamlet+macbeth, gpl-3, ...")
    ppl.add_argument("--text-file", default=None, help="score this UTF-8 file instead of --text (default: none)")
    ppl.add_argument("--max-tokens", type=int, default=4096, help="tokens of text to score")
    ppl.add_argument("--chunk-size", type=int, default=None,
                     help="tokens scored per forward (default: one cache block, which equals token-by-token decode)")
    ppl.add_argument("--agreement-prompts", type=int, default=12,
                     help="greedy agreement prompts x 64 tokens, at most one per ~152 scored tokens (0 = skip)")
    ppl.add_argument("--no-progress", action="store_true", help="no progress bars (default: bars when stderr is a terminal)")
    ppl.add_argument("--json", action="store_true", help="print JSON")
    ppl.add_argument("--segment", type=int, default=None, help="also report perplexity and peak KV per segment of N tokens (default: off)")
    add_policy_options(ppl)
    ppl.set_defaults(func=run_ppl)
    register_passkey(esub)


def log(text: str) -> None:
    print(f"[eval] {text}", file=sys.stderr, flush=True)


def run_ppl(args) -> int:
    from kvforge.bench.progress import default_enabled
    from kvforge.eval.ppl import ppl_eval
    from kvforge.eval.texts import load_text
    from kvforge.models.loader import load_model

    text = load_text(args.text, args.text_file)
    log(f"loading {args.model or 'the embedded SmolLM2-135M'}")
    loaded = load_model(args.model)
    r = ppl_eval(loaded, text, args.max_tokens, args.chunk_size, args.agreement_prompts, segment=args.segment,
                 progress=not args.no_progress and default_enabled(), log=log, **format_kwargs(args), **policy_kwargs(args))
    if args.json:
        json.dump(r, sys.stdout, indent=2)
        print()
    else:
        print(f"text: {args.text_file or args.text}, {r['tokens']} tokens, chunks of {r['chunk_size']}")
        print(f"fp32 cache   ppl {r['ppl_baseline']:.4f}   {r['kv_bytes_per_token_baseline']:.0f} B/token")
        print(f"{args.kv_dtype:<12} ppl {r['ppl']:.4f}   {r['kv_bytes_per_token']:.0f} B/token   delta {r['delta_pct']:+.2f}%")
        if args.kv_policy:
            print(f"kv policy {args.kv_policy} budget {args.budget}: peak KV {r['peak_kv_bytes'] / 2**20:.1f} MiB "
                  f"(full cache {r['peak_kv_bytes_baseline'] / 2**20:.1f} MiB over {r['baseline_tokens']} tokens)")
        for i, p in enumerate(r.get("segments", [])):
            print(f"segment {i}: ppl {p:.4f}   peak KV {r['segment_peak_kv_bytes'][i] / 2**20:.1f} MiB")
        if "greedy" in r:
            g = r["greedy"]
            print(f"greedy agreement: {g['token_agreement']:.3f} of tokens, {g['identical_outputs']}/{g['prompts']} outputs identical")
    return 0
