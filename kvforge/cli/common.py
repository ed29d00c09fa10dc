"""Options shared by subcommands that build an engine."""
from __future__ import annotations

import argparse
import re

from kvforge.errors import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """'512MiB', '24GB', '80GiB' or plain bytes -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"size {text!r} is not understood; write bytes or a number with KiB/MiB/GiB/KB/MB/GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


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
