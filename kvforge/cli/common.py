"""Options shared by subcommands that build an engine."""
from __future__ import annotations

import argparse

from kvforge.memcalc import parse_size


def add_engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: embedded SmolLM2-135M)")
    g.add_argument("--kv-memory", default=None, help="KV cache budget, e.g. 512MiB (default: 10%% of free memory)")
    g.add_argument("--kv-dtype", default="fp32", help="KV storage format")
    g.add_argument("--kv-layout", default="paged", choices=["paged", "contiguous"])
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true", help="turn prefix sharing off")
    g.add_argument("--device", default=None)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {
        "model": args.model,
        "kv_cache_memory": parse_size(args.kv_memory) if args.kv_memory else None,
        "kv_cache_dtype": args.kv_dtype,
        "kv_layout": args.kv_layout,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": not args.no_prefix_caching,
        "device": args.device,
    }
