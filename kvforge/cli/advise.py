"""`kvforge advise [MODEL]`: walk a selection tree to an engine configuration, or with --measure rank
candidate configurations by memory, quality and speed measured on the model itself."""
from __future__ import annotations

import argparse
import json
import sys

from kvforge.advise import PRIORITIES, Advice, AdviseInputs, Measurement, advise, parse_context
from kvforge.cli.memory import human
from kvforge.errors import ConfigError, ModelLoadError
from kvforge.memcalc import WEIGHT_BYTES_PER_PARAM, parse_size
from kvforge.presets import PRESETS

DEFAULT_MODEL = "smollm2-135m"
MEASURE_DTYPES = ("fp16", "fp8_e4m3", "int8", "int4", "kivi2")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("advise", help="recommend a KV cache configuration (tree, or --measure)",
                              description=__doc__, epilog=f"presets: {', '.join(PRESETS)}")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help="preset, config.json (or its directory), .gguf file or HF model directory "
                        "(default: the embedded SmolLM2-135M)")
    p.add_argument("--context", default=None, help="typical tokens per sequence: 8192, 32K, or 'unbounded' "
                                                   "(default: min(model context, 4096))")
    p.add_argument("--priority", choices=PRIORITIES, default="balanced", help="what to favour: quality, memory or both")
    p.add_argument("--max-quality-loss", type=float, default=None, metavar="PCT",
                   help="largest perplexity increase accepted, in %% (default: quality 0.1, balanced 1, efficiency 2)")
    p.add_argument("--shared-prefix", action="store_true", help="requests share system prompts / multi-turn history")
    p.add_argument("--memory", help="device memory for weights + KV, e.g. 24GiB, 512MiB (default: none, no fit check)")
    p.add_argument("--batch", type=int, default=1, help="concurrent sequences (default 1)")
    p.add_argument("--weights-dtype", choices=list(WEIGHT_BYTES_PER_PARAM), default=None,
                   help="estimate weight bytes from the parameter count at this dtype (default: a GGUF file as "
                        "kvforge's engine holds it, else the published dtype)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    m = p.add_argument_group("measure")
    m.add_argument("--measure", action="store_true", help="measure candidates on the model instead of trusting the tree")
    m.add_argument("--candidates", default=None,
                   help=f"comma list of DTYPE[+POLICY:BUDGET], e.g. int8,int4+streaming:512 "
                        f"(default: {','.join(MEASURE_DTYPES)} and the tree's pick)")
    m.add_argument("--eval-tokens", type=int, default=1024, help="tokens of text for perplexity (default 1024)")
    m.add_argument("--text", default="hamlet", help="hamlet, macbeth, gpl-3, ... (see kvforge eval ppl)")
    m.add_argument("--text-file", default=None, help="score this UTF-8 file instead of --text (default: none)")
    m.add_argument("--requests", type=int, default=4, help="requests in the speed workload (default 4)")
    m.add_argument("--output-tokens", type=int, default=32, help="tokens each speed request decodes (default 32)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def inputs_from_args(args: argparse.Namespace, model: str) -> AdviseInputs:
    context = 0 if args.context is None else parse_context(args.context)
    memory = None if args.memory is None else parse_size(args.memory)
    return AdviseInputs(model, context, args.priority, args.max_quality_loss, args.shared_prefix, memory or None,
                        args.batch, args.weights_dtype, args.block_size)


def _model_path(model: str) -> str | None:
    """What load_model takes: None for the embedded SmolLM2; presets have no weights."""
    if model == DEFAULT_MODEL:
        return None
    if model.lower() in PRESETS:
        raise ConfigError(f"--measure needs weights: {model!r} is a preset (a config only); give a .gguf file or "
                          f"a Hugging Face model directory, or omit MODEL for the embedded SmolLM2-135M")
    return model


def _tree_model(model: str) -> str:
    if model != DEFAULT_MODEL:
        return model
    try:
        from kvforge.models.loader import default_model_path

        return default_model_path()
    except ModelLoadError:  # the embedded package is missing: its preset has the same architecture
        return DEFAULT_MODEL


def run(args: argparse.Namespace) -> int:
    inputs = inputs_from_args(args, _tree_model(args.model))
    if args.measure:
        return run_measure(args, inputs)
    a = advise(inputs)
    print(json.dumps(a.to_dict(), indent=2) if args.json else format_advice(a))
    return 0


def run_measure(args: argparse.Namespace, inputs: AdviseInputs) -> int:
    from kvforge.advise import Candidate, measure, parse_candidates
    from kvforge.eval.texts import load_text
    from kvforge.models.loader import load_model

    path = _model_path(args.model)
    if args.requests < 1 or args.output_tokens < 1:
        raise ConfigError(f"--requests and --output-tokens must be >= 1, got {args.requests}, {args.output_tokens}")
    if args.eval_tokens < 64:
        raise ConfigError(f"--eval-tokens must be >= 64 for a meaningful perplexity, got {args.eval_tokens}")
    tree = advise(inputs)
    if args.candidates:
        candidates = parse_candidates(args.candidates)
    else:
        candidates = [Candidate(d) for d in MEASURE_DTYPES]
        rec = tree.recommendation
        if rec.kv_policy:
            budget = rec.kv_policy_options["budget"]
            budget = budget if budget < args.eval_tokens else max(64, args.eval_tokens // 4)
            candidates.append(Candidate(rec.kv_cache_dtype, rec.kv_policy, budget))
    text = load_text(args.text, args.text_file)
    loaded = load_model(path)
    log = (lambda s: print(f"[advise] {s}", file=sys.stderr, flush=True))
    result = measure(loaded, candidates, text, args.eval_tokens, inputs.priority, inputs.tolerance,
                     requests=args.requests, output_tokens=args.output_tokens, shared_prefix=inputs.shared_prefix,
                     text_name=args.text_file or args.text, log=log)
    if args.json:
        print(json.dumps({**result.to_dict(), "tree": tree.to_dict()}, indent=2))
    else:
        print(format_measurement(result, tree))
    return 0


def format_advice(a: Advice) -> str:
    lines = [f"model: {a.model} ({a.attention_kind})", "", "path:"]
    for i, s in enumerate(a.path, 1):
        lines.append(f"  {i}. {s.question}  -> {s.answer}   [{s.source}]")
        if s.detail:
            lines.append(f"       {s.detail}")
    r = a.recommendation
    lines += ["", f"recommendation: {a.outcome}", f"  flags:  {r.cli_flags()}", f"  python: {r.python()}", ""]
    lines += _memory_lines(a)
    lines += [f"note: {n}" for n in a.notes]
    return "\n".join(lines)


def _memory_lines(a: Advice) -> list[str]:
    mc = a.memory
    head = f"memory at {mc.context:,} tokens per sequence"
    if mc.kv_budget_bytes is not None:
        head += (f" (KV budget {human(mc.kv_budget_bytes)} = memory - {human(mc.weights_bytes)} of weights: "
                 f"{mc.weights_source})")
    out = [head + ":", f"  {'configuration':<36}{'B/token':>10}{'tokens':>9}{'per sequence':>14}"
           + (f"{'max batch':>11}" if mc.kv_budget_bytes is not None else "")]
    for ln in mc.lines:
        row = f"  {ln.label:<36}{ln.bytes_per_token:>10,.0f}{ln.cached_tokens:>9,}{human(ln.bytes_per_sequence):>14}"
        out.append(row + (f"{ln.max_batch:>11,}" if ln.max_batch is not None else ""))
    out.append(f"  -> {mc.saving:.1f}x less KV per sequence than the fp32 full cache")
    return out


def format_measurement(m: Measurement, tree: Advice) -> str:
    b = m.baseline
    w = m.workload
    speed = f"{w['requests']} requests x {w['output_tokens']} output tokens"
    lines = [f"model: {m.model}",
             f"quality: perplexity on {m.tokens} tokens of {m.text}; speed: {speed}",
             f"baseline fp32 full cache: ppl {b['ppl']:.4f}, peak KV {human(b['peak_kv_bytes'])}, {b['tok_s']:.1f} tok/s",
             f"priority {m.priority}: {m.rule}; max quality loss {m.max_quality_loss:g}%", "",
             (f"  {'rank':<5}{'candidate':<22}{'B/token':>9}{'peak KV':>12}{'KV vs fp32':>11}{'ppl':>9}"
              f"{'delta %':>9}{'tok/s':>8}{'speed':>7}{'score':>7}")]
    for r in m.rows:
        rank = str(r.rank) if r.rank else "-"
        lines.append(f"  {rank:<5}{r.name:<22}{r.kv_bytes_per_token:>9,.0f}{human(r.peak_kv_bytes):>12}"
                     f"{r.kv_fraction:>11.3f}{r.ppl:>9.4f}{r.delta_pct:>+9.3f}{r.tok_s:>8.1f}{r.speed_ratio:>7.2f}"
                     f"{r.score:>7.3f}" + ("" if r.eligible else "  (over the loss limit)"))
    lines.append("")
    if m.recommendation:
        rec = m.recommendation
        lines += [f"choice: {m.choice}", f"  flags:  {rec.cli_flags()}", f"  python: {rec.python()}"]
    lines.append(f"tree's pick for comparison: {tree.recommendation.label}")
    lines += [f"note: {n}" for n in m.notes]
    lines.append(f"measured in {m.seconds:.0f} s")
    return "\n".join(lines)
