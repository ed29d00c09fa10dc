"""kvforge eval: quality of KV techniques on real text (perplexity; more evals register here)."""
from __future__ import annotations

import json
import sys

from kvforge.cli.common import add_format_options, add_policy_options, format_kwargs, policy_kwargs
from kvforge.cli.passkey import register_passkey
from kvforge.cli.retrieval import register_retrieval


def register(sub) -> None:
    p = sub.add_parser("eval", help="measure quality of KV techniques on real text")
    esub = p.add_subparsers(dest="eval", required=True)
    ppl = esub.add_parser("ppl", help="decode-faithful perplexity vs the fp32 full cache, in one run")
    ppl.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2-135M)")
    add_format_options(ppl)
    technique_default(ppl)
    ppl.add_argument("--text", default="hamlet", help="hamlet, macbeth, hamlet+macbeth, gpl-3, ...")
    ppl.add_argument("--text-file", default=None, help="score this UTF-8 file instead of --text (default: none)")
    ppl.add_argument("--max-tokens", type=int, default=4096, help="tokens of text to score")
    ppl.add_argument("--chunk-size", type=int, default=None,
                     help="tokens scored per forward (default: one cache block, which equals token-by-token decode)")
    ppl.add_argument("--agreement-prompts", type=int, default=12,
                     help="greedy agreement prompts x 64 tokens, at most one per ~152 scored tokens (0 = skip)")
    ppl.add_argument("--no-progress", action="store_true", help="no progress bars (default: bars when stderr is a terminal)")
    ppl.add_argument("--json", action="store_true", help="print JSON")
    ppl.add_argument("--weights", default="fp32", choices=["auto", "fp32", "int8"],
                     help="weights of the scored engine: auto (a GGUF's block tensors as stored), fp32, int8 (the "
                          "baseline keeps fp32 weights and cache)")
    ppl.add_argument("--segment", type=int, default=None, help="also report perplexity and peak KV per segment of N tokens (default: off)")
    add_policy_options(ppl)
    panel = ppl.add_argument_group("panel (the texts the quality goals hold on; see docs/results.md)")
    panel.add_argument("--panel", action="store_true",
                       help="score the panel of texts (fp32 cache once per text) and report each delta, worst and mean")
    panel.add_argument("--texts", default=None,
                       help="comma-separated texts for --panel (default: hamlet,merry-wives,gpl-3,python-reference,"
                            "stdlib-comments; the held-out text is idle-news)")
    panel.add_argument("--variant", action="append", default=[], metavar="SPEC",
                       help="with --panel, also score FORMAT[:OPTIONS][+POLICY:BUDGET[:OPTIONS]], e.g. "
                            "'int4:{\"group_size\": 32}' or 'int8+h2o:0.5' (repeatable)")
    panel.add_argument("--rows-file", default=None,
                       help="with --panel, append each scored row to this JSON-lines file and skip rows already in it "
                            "(default: none)")
    ppl.set_defaults(func=run_ppl)
    register_passkey(esub)
    register_retrieval(esub)


DEFAULT_TECHNIQUE = "int8"


def technique_default(ppl) -> None:
    """--kv-dtype unset: int8 when no --kv-policy is given either (fp32 against the fp32 baseline measures nothing)."""
    action = next(a for a in ppl._actions if a.dest == "kv_dtype")
    action.default = None
    action.help += (f" (default: {DEFAULT_TECHNIQUE} when no --kv-policy is given, else fp32, so there is always a "
                    "technique to compare with the fp32 baseline; --panel scores every variant you pass)")


def resolve_technique(args) -> None:
    if args.kv_dtype is None:
        args.kv_dtype = "fp32" if args.kv_policy or (args.panel and args.variant) else DEFAULT_TECHNIQUE
        if args.kv_dtype != "fp32":
            log(f"no technique given: scoring the {args.kv_dtype} cache against fp32 (pass --kv-dtype FORMAT, "
                "--kv-policy POLICY --budget N, or --panel --variant SPEC for others)")


def log(text: str) -> None:
    print(f"[eval] {text}", file=sys.stderr, flush=True)


def run_ppl(args) -> int:
    from kvforge.eval.ppl import ppl_eval
    from kvforge.eval.texts import load_text
    from kvforge.models.loader import load_model
    from kvforge.progress import default_enabled

    resolve_technique(args)
    if args.panel:
        if args.weights != "fp32":
            from kvforge.errors import ConfigError

            raise ConfigError("--weights int8 scores one text (--text or --text-file); --panel compares KV variants "
                              "on fp32 weights only")
        return run_panel(args)
    text = load_text(args.text, args.text_file)
    log(f"loading {args.model or 'the embedded SmolLM2-135M'}")
    loaded = load_model(args.model, weights=args.weights)
    r = ppl_eval(loaded, text, args.max_tokens, args.chunk_size, args.agreement_prompts, segment=args.segment,
                 progress=not args.no_progress and default_enabled(), log=log, weights=args.weights, **format_kwargs(args),
                 **policy_kwargs(args))
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


def flags_variant(args) -> str:
    """The variant spec (see kvforge.eval.panel) that --kv-dtype, --kv-options and --kv-policy name."""
    spec = args.kv_dtype + (f":{args.kv_options}" if args.kv_options else "")
    if args.kv_policy:
        spec += f"+{args.kv_policy}:{args.budget}" + (f":{args.kv_policy_options}" if args.kv_policy_options else "")
    return spec


def run_panel(args) -> int:
    from kvforge.eval.panel import panel_eval, parse_variant
    from kvforge.eval.texts import PANEL
    from kvforge.models.loader import load_model

    specs = ([] if args.variant and args.kv_dtype == "fp32" and not args.kv_policy else [flags_variant(args)])
    variants = [parse_variant(s) for s in [*specs, *args.variant]]
    texts = args.texts.split(",") if args.texts else list(PANEL)
    log(f"loading {args.model or 'the embedded SmolLM2-135M'}; {len(texts)} texts x (fp32 + {len(variants)} variants)")
    loaded = load_model(args.model)
    r = panel_eval(loaded, variants, texts, args.max_tokens, args.rows_file, log=None if args.json else log)
    if args.json:
        json.dump(r, sys.stdout, indent=2)
        print()
        return 0
    print(format_panel(r))
    return 0


def format_panel(r: dict) -> str:
    texts = r["texts"]
    width = max(12, *(len(t) for t in texts))
    lines = [f"{r['tokens']} tokens per text; delta = perplexity vs the fp32 cache on the same text",
             f"{'variant':<44} {'B/token':>8} " + " ".join(f"{t:>{width}}" for t in texts) + "     worst      mean"]
    for label, v in r["variants"].items():
        cells = " ".join(f"{v['deltas'][t]:>+{width - 1}.2f}%" if t in v["deltas"] else f"{'-':>{width}}" for t in texts)
        lines.append(f"{label:<44} {v['kv_bytes_per_token']:>8.0f} {cells} {v['worst_pct']:>+8.2f}% {v['mean_pct']:>+8.2f}%")
    base = {row["text"]: row["ppl"] for row in r["rows"] if row["variant"].startswith("fp32 (")}
    lines.append("fp32 ppl: " + ", ".join(f"{t} {base[t]:.3f}" for t in texts if t in base))
    return "\n".join(lines)
