"""`kvforge memory MODEL`: KV bytes per token / sequence / batch, MHA ratio, and what fits in a budget.

Defaults are what kvforge's engine would run: its KV format (--kv-dtype {kv}) and, for 'what fits', the weight
bytes it would hold (weights={weights}: every layout its kernels read; a published-dtype estimate for an
architecture it does not run). --kv-dtype, --weights-dtype and --weights model other engines, e.g. a vLLM fp16
deployment: --kv-dtype fp16 --weights-dtype fp16."""
from __future__ import annotations

import argparse
import json

from kvforge.config import EngineConfig
from kvforge.errors import ConfigError
from kvforge.kv.tiers.parse import parse_tiers
from kvforge.memcalc import (
    ENGINE_WEIGHTS,
    WEIGHT_BYTES_PER_PARAM,
    MemoryReport,
    memory_report,
    parse_size,
    resolve_model,
)
from kvforge.presets import PRESETS

ENGINE_KV_DTYPE, ENGINE_WEIGHTS_MODE = EngineConfig.kv_cache_dtype, EngineConfig.weights
DESCRIPTION = __doc__.format(kv=ENGINE_KV_DTYPE, weights=ENGINE_WEIGHTS_MODE)
EPILOG = f"presets: {', '.join(PRESETS)}"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("memory", help="KV cache memory calculator", description=DESCRIPTION,
                               epilog=EPILOG)
    p.add_argument("model", nargs="?", default=None,
                   help="preset name, any decoder's config.json (or its directory), or .gguf file "
                        "(default smollm2-135m)")
    p.add_argument("--model", dest="model_option", metavar="MODEL", help="the same, as an option (default: the positional MODEL, else smollm2-135m)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's context length)")
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--kv-dtype", default=ENGINE_KV_DTYPE,
                   help=f"KV storage format (default {ENGINE_KV_DTYPE}, the engine's; fp16 models a vLLM deployment)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--memory", help="device memory for 'what fits', e.g. 80GiB, 24GB, 512MiB, or bytes "
                                    "(default: none, no 'what fits')")
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--weights", help="bytes the weights take, e.g. 14GB (default: as kvforge's engine would "
                                           f"hold them, weights={ENGINE_WEIGHTS_MODE} plus the panel copies its "
                                           "kernels read; the parameter count at the published dtype for an "
                                           "architecture it does not run; printed)")
    weights.add_argument("--weights-dtype", choices=list(WEIGHT_BYTES_PER_PARAM),
                         help="estimate weights from the parameter count at this dtype (default: see --weights)")
    weights.add_argument("--engine-weights", choices=list(ENGINE_WEIGHTS),
                         help="the bytes kvforge's engine holds with this weights mode: every layout its kernels "
                              "read, e.g. fp32 weights plus their panel copies (default: see --weights)")
    p.add_argument("--kv-tier", dest="kv_tiers", action="append", default=None, metavar="TIER",
                   help="also show what a KV tier holds in tokens of this format, e.g. host:8GiB or disk:PATH:100GiB "
                        "(repeatable; default: none)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def tier_capacity(tiers: list[str] | None, bytes_per_token: float) -> list[dict]:
    """Tokens each sized tier holds: blocks stay in their stored format (compressed formats hold more tokens)."""
    out = []
    for spec in parse_tiers(tiers) or []:
        size = spec.capacity_bytes
        out.append({"tier": str(spec), "bytes": size, "tokens": int(size // bytes_per_token) if size else None})
    return out


def run(args: argparse.Namespace) -> int:
    if args.model and args.model_option and args.model != args.model_option:
        raise ConfigError(f"two models given ({args.model!r} and --model {args.model_option!r}); give one")
    report = memory_report(
        resolve_model(args.model_option or args.model or "smollm2-135m"), seq_len=args.seq_len, batch=args.batch, kv_dtype=args.kv_dtype,
        block_size=args.block_size, memory=None if args.memory is None else parse_size(args.memory),
        weights=None if args.weights is None else parse_size(args.weights), weights_dtype=args.weights_dtype,
        engine_weights=args.engine_weights, engine_default=ENGINE_WEIGHTS_MODE,
    )
    tiers = tier_capacity(args.kv_tiers, report.per_token_bytes)
    if args.json:
        print(json.dumps({**report.to_dict(), **({"kv_tiers": tiers} if tiers else {})}, indent=2))
        return 0
    print(format_report(report))
    for t in tiers:
        held = f"{t['tokens']:,} tokens in {human(t['bytes'])}" if t["bytes"] else "bounded by the server's maxmemory"
        print(f"  tier {t['tier']:<24} {held}")
    return 0


def human(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:g} B"


def _bytes(n: float) -> str:
    return f"{human(n):>12}  ({n:,.0f} B)" if n >= 1024 else f"{human(n):>12}"


def format_report(r: MemoryReport) -> str:
    lines = [
        f"{r.model}: {r.arch}, {r.attention_kind}, {r.parameters / 1e9:.2f}B parameters, context {r.max_context:,}",
        f"kv_dtype {r.kv_dtype}, block_size {r.block_size}, seq_len {r.seq_len:,}, batch {r.batch}",
        "",
        f"  elements per token   {r.per_token_elements:>12,}",
        f"  bytes per token      {_bytes(r.per_token_bytes)}",
        *([(f"    full-attention     {_bytes(r.full_attention_per_token_bytes)}  per token, {r.full_attention_layers} "
            f"layers; the {r.window_layers} window layers hold at most {human(r.window_cap_bytes)} per sequence")]
          if r.window_layers else []),
        f"  per sequence         {_bytes(r.per_sequence_bytes)}",
        *([(f"    of which state     {_bytes(r.state_bytes_per_sequence)}  ({r.recurrent_layers} recurrent layers, "
            "any length)")] if r.recurrent_layers else []),
        *([f"    of which fp16 side {_bytes(r.side_bytes_per_sequence)}  (staging, window, sinks)"]
          if r.side_bytes_per_sequence else []),
        f"  {f'total (batch {r.batch})':<21}{_bytes(r.total_bytes)}",
        f"  block overhead       {_bytes(r.block_overhead_bytes)}",
        f"  mha_ratio            {r.mha_ratio:>12.4f}  (full MHA: {human(r.mha_per_token_bytes)} per token)",
    ]
    if r.fits:
        f = r.fits
        lines += [
            "",
            f"what fits in {human(f.memory_bytes)}:",
            f"  weights              {_bytes(f.weights_bytes)}  ({f.weights_source})",
            f"  KV budget            {_bytes(f.kv_budget_bytes)}  ({f.num_blocks:,} blocks)",
            f"  max batch at {r.seq_len:,} tokens    {f.max_batch:,}",
            f"  max seq_len at batch {r.batch}     {f.max_seq_len:,} tokens",
        ]
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)
