"""kvforge lab: the whole matrix of KV techniques on one model and text, with a report (HTML, plots, JSON)."""
from __future__ import annotations

import argparse
import os
import signal
import sys


def _budget(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"budgets are KV token counts, e.g. 128 256 512; got {text!r}") from None


def _fraction(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"fractions are shares of the sequence kept, e.g. 0.25 0.5; got {text!r}") from None


def register(sub) -> None:
    p = sub.add_parser("lab", help="measure every KV technique on a model and text; write a report with plots",
                       description=__doc__)
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: embedded SmolLM2-135M)")
    p.add_argument("--text", default="hamlet", help="a named text (hamlet, macbeth, hamlet+macbeth, gpl-3) or a file")
    p.add_argument("--tokens", type=int, default=None, help="tokens of text scored for perplexity (default: quick 512, full 4096)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick", help="a few minutes (default)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full", help="the whole matrix")
    p.add_argument("--out", default="kvforge-lab", help="output folder; re-running with it reuses measured cells")
    p.add_argument("--formats", nargs="+", default=None, help='format specs, e.g. int8 int4 \'int4:{"group_size": 32}\' (default: the mode\'s set)')
    p.add_argument("--policies", nargs="+", default=None, help="window streaming h2o scissorhands snapkv (default: the mode's set)")
    p.add_argument("--budgets", nargs="+", type=_budget, default=None, help="KV tokens kept (default 1/8, 1/4, 1/2 of --tokens)")
    p.add_argument("--priority", choices=["quality", "balanced", "efficiency"], default="balanced",
                   help="how the advisor ranks the measured candidates")
    p.add_argument("--panel", action="store_true",
                   help="quality cells score every panel text (kvforge eval ppl --panel) and report the worst and mean")
    p.add_argument("--methods", nargs="*", default=None,
                   help="policies measured at --fractions of the sequence kept, on the panel or text and the retrieval "
                        "suite (default: keydiff tova expected_attention kvzip; none with an empty list)")
    p.add_argument("--fractions", nargs="+", type=_fraction, default=None,
                   help="shares of the sequence --methods keep (default: quick 0.5, full 0.25 0.5 0.75)")
    p.add_argument("--retrieval", action="store_true",
                   help="also the retrieval suite (kvforge eval retrieval) for the full cache and each method x share")
    p.add_argument("--heatmap", default=None, help="the method of the retrieval heat map (default: the first method)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    p.set_defaults(func=run, mode="quick")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # a `kill` stops the lab like Ctrl-C: the report of what finished is still written


def run(args) -> int:
    from kvforge.lab import LabOptions, run_lab

    options = LabOptions(args.model, args.text, args.out, args.mode, args.tokens, args.formats, args.policies,
                         args.budgets, args.priority, not args.no_progress, args.panel, args.methods,
                         args.fractions, args.retrieval, args.heatmap)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        lab_run, _ = run_lab(options)
    finally:
        signal.signal(signal.SIGTERM, previous)
    report = os.path.join(args.out, "report.html")
    if lab_run.interrupted:
        print(f"kvforge lab: interrupted; the report of what finished is in {report}", file=sys.stderr)
        return 130
    print(f"{len(lab_run.measured)} cells measured, {len(lab_run.reused)} reused, {lab_run.seconds:.0f} s: {report}")
    return 0
