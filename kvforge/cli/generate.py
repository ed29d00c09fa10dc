"""kvforge generate: one completion, printed as text or JSON with KV cache statistics."""
from __future__ import annotations

import json
import sys

from kvforge.cli.common import add_engine_options, engine_kwargs


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true")
    add_engine_options(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from kvforge import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    llm = LLM(**engine_kwargs(args))
    engine = llm.engine
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    s = engine.stats()
    stats = {
        "kv_blocks_total": s["kv_blocks_total"],
        "kv_blocks_used_peak": s["kv_blocks_used_peak"],
        "kv_blocks_used_now": s["kv_blocks_used"],
        "kv_block_size": s["kv_block_size"],
        "kv_bytes_per_token": engine.kv.block_bytes / engine.kv.block_size,
        "kv_bytes_peak": s["kv_blocks_used_peak"] * engine.kv.block_bytes,
        "kv_bytes_total": s["kv_bytes_total"],
        "kv_cache_dtype": s["kv_cache_dtype"],
        "prompt_tokens": out.metrics.prompt_tokens,
        "generated_tokens": out.metrics.generated_tokens,
        "ttft_s": out.metrics.ttft,
        "finish_reason": out.finish_reason,
        **{k: v for k, v in s.items() if k.startswith("spec_")},
    }
    if args.json:
        json.dump({"text": out.text, "token_ids": out.token_ids, "stats": stats}, sys.stdout, indent=2)
        print()
    else:
        print((args.prompt if not args.chat else "") + out.text)
        print(f"\n[kv cache] {stats['kv_cache_dtype']}, {stats['kv_bytes_per_token']:.0f} bytes/token, "
              f"peak {stats['kv_blocks_used_peak']}/{stats['kv_blocks_total']} blocks of {stats['kv_block_size']} tokens "
              f"= {stats['kv_bytes_peak'] / 2**20:.2f} MiB of {stats['kv_bytes_total'] / 2**20:.0f} MiB; "
              f"{stats['prompt_tokens']} prompt + {stats['generated_tokens']} generated tokens, "
              f"ttft {stats['ttft_s']:.3f}s, finish: {stats['finish_reason']}", file=sys.stderr)
    return 0
