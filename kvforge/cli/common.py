"""Options shared by subcommands that build an engine."""
from __future__ import annotations

import argparse

from kvforge.config import PREFILL_ORDERS, WEIGHT_KINDS, EngineConfig
from kvforge.errors import ConfigError
from kvforge.kv.tiers.persist import CLOSE_TIMEOUT_S
from kvforge.memcalc import parse_size
from kvforge.options import json_object


def add_engine_options(p: argparse.ArgumentParser, model_option: bool = True) -> None:
    g = p.add_argument_group("engine (vLLM's names where vLLM has the option)")
    if model_option:
        g.add_argument("-m", "--model", default=None, help="GGUF file, Hugging Face directory or packaged name "
                       "(gemma3-270m; default: embedded SmolLM2-135M); kvforge never downloads from a model hub")
    memory = g.add_mutually_exclusive_group()
    memory.add_argument("--kv-memory", "--kv-cache-memory", default=None, metavar="SIZE",
                        help="KV cache budget, e.g. 512MiB, 2GB (default: --gpu-memory-utilization of free memory)")
    memory.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                        help="share of free device memory (CPU: free RAM) given to the KV cache, in (0, 0.95] "
                             f"(default: {EngineConfig.kv_cache_memory_fraction})")
    add_format_options(g)
    g.add_argument("--kv-layout", default="paged", choices=["paged", "contiguous"], help="KV cache layout")
    g.add_argument("--block-size", type=int, default=EngineConfig.block_size, help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs, help="most sequences running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
                   help="tokens per step (the chunked-prefill budget)")
    add_prefill_order(g)
    g.add_argument("--max-model-len", "-c", "--ctx-size", type=int, default=None,
                   help="longest sequence, prompt + output (default: the model's context length, capped to what one "
                        "sequence can hold in the KV budget; the start-up line says when)")
    prefix = g.add_mutually_exclusive_group()
    prefix.add_argument("--no-prefix-caching", action="store_true", help="turn prefix sharing off")
    prefix.add_argument("--enable-prefix-caching", dest="no_prefix_caching", action="store_false",
                        help="prefix sharing on (vLLM's flag; already the default)")
    g.add_argument("--dtype", default="auto", type=_dtype,
                   help="weights' compute dtype, vLLM's flag: auto or float32 (kvforge computes in float32; "
                        "--weights int8 makes the weights smaller, --kv-cache-dtype the cache)")
    g.add_argument("--tensor-parallel-size", "-tp", type=_tensor_parallel, default=1,
                   help="devices one model is split over, vLLM's flag: only 1 (kvforge runs a model on one device; "
                        "serve --ray runs replicas)")
    g.add_argument("--no-kv-groups", action="store_true",
                   help="keep every layer's whole history, sliding-window layers too (the old behaviour; "
                        "default: sliding-window layers form KV groups that free blocks behind the window)")
    g.add_argument("--weights", default=EngineConfig.weights, choices=list(WEIGHT_KINDS),
                   help="weights (default: %(default)s): auto (as stored: a GGUF's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 tensors stay quantized and are "
                        "computed in place), fp32 (dequantized at load), int8 (per-output-channel scales, fp32 "
                        "activations), q8_0 (an fp32 model quantized at load into Q8_0 blocks) or q4_0 (its layers into "
                        "Q4_0 blocks, the embedding and LM head Q8_0)")
    g.add_argument("--device", default=None, help="torch device, e.g. cpu, cuda:0 (default: cuda when present, else cpu)")
    g.add_argument("--speculative", default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\' (default: off)')
    add_policy_options(g)
    g.add_argument("--kv-tier", dest="kv_tiers", action="append", default=None, metavar="TIER",
                   help="a KV tier below the pool, repeatable, in lookup order: host:8GiB, disk:PATH:100GiB, "
                        "redis://HOST:PORT[/DB] (default: none)")
    write = g.add_mutually_exclusive_group()
    write.add_argument("--kv-tier-write-through", dest="kv_tier_write_through", action="store_const", const=True,
                       default=None, help="every KV tier stores a block as soon as it is cached (as in SGLang HiCache). "
                       "Default: write-through for disk and redis tiers (other processes reuse a block at once; a "
                       "crash keeps every block stored before it), write-back for host tiers")
    write.add_argument("--kv-tier-write-back", dest="kv_tier_write_through", action="store_const", const=False,
                       help="a KV tier stores a block only when it leaves the pool (or the tier above): fewer writes; a "
                            f"clean stop (end of run, Ctrl-C, SIGTERM) writes the cached blocks to disk and redis tiers "
                            f"within {CLOSE_TIMEOUT_S:.0f} s, a crash loses every block not yet evicted (default: only host "
                            "tiers write back)")
    g.add_argument("--no-kv-tier-fsync", action="store_true",
                   help="do not fsync disk-tier block files (faster stores; a power cut may lose recent blocks)")
    g.add_argument("--preemption-mode", default=None, choices=["recompute", "swap"],
                   help="what a preempted sequence's KV does: recomputed later, or swapped to host memory "
                        "(default: swap when --kv-policy evicts and a host tier is set, else recompute)")


def add_prefill_order(g) -> None:
    g.add_argument("--prefill-order", default=EngineConfig.prefill_order, choices=list(PREFILL_ORDERS),
                   help="which waiting requests start first: shortest (fewest uncached prompt tokens first, in groups "
                        "sized to a step's cost; none overtaken without bound) or fcfs (arrival order, vLLM's and "
                        "SGLang's default); default: %(default)s")


def add_format_options(g) -> None:
    g.add_argument("--kv-dtype", "--kv-cache-dtype", dest="kv_dtype", default="fp32",
                   help="KV storage format: fp32, fp16, bf16, fp8_e4m3, fp8_e5m2, int8, int4, kivi2")
    g.add_argument("--kv-options", default=None, help='format options as JSON, e.g. \'{"group_size": 32}\' (default: none)')


def format_kwargs(args: argparse.Namespace) -> dict:
    return {"kv_cache_dtype": args.kv_dtype,
            "kv_cache_options": json_object("--kv-options", args.kv_options, '{"group_size": 32}') or None}


def add_policy_options(g) -> None:
    g.add_argument("--kv-policy", default=None, choices=["full", "window", "streaming", "h2o", "scissorhands", "snapkv", "keydiff", "tova",
                                                           "expected_attention", "kvzip"],
                   help="KV eviction policy, on full-attention layers (default: full; sliding-window layers "
                        "free what falls behind their window anyway)")
    g.add_argument("--budget", type=_budget, default=None,
                   help="KV tokens kept by --kv-policy: a count (1024) or a fraction (0.5) of the tokens seen "
                        "(default: 1024 for window and streaming, 0.5 for h2o, scissorhands, snapkv, keydiff, tova, expected_attention and kvzip)")
    g.add_argument("--kv-policy-options", default=None,
                   help='more policy options as JSON, e.g. \'{"sinks": 4}\' (default: none)')


def _dtype(text: str) -> str:
    if text.lower() in ("auto", "float32", "float", "fp32"):
        return "float32"
    raise argparse.ArgumentTypeError(f"{text!r} is not supported: kvforge computes in float32 (auto, float32); for "
                                     "less memory use --weights int8 (weights) or --kv-cache-dtype (the KV cache)")


def _tensor_parallel(text: str) -> int:
    if text.strip() == "1":
        return 1
    raise argparse.ArgumentTypeError(f"{text!r}: kvforge runs one model on one device, so only 1 is supported; for "
                                     "more throughput run replicas with serve --ray --num-replicas N")


def _budget(text: str) -> int | float:
    value = float(text)
    if value.is_integer() and value >= 1:
        return int(value)
    if 0 < value < 1:
        return value
    raise argparse.ArgumentTypeError(f"budget must be a token count >= 1 or a fraction in (0, 1), got {text!r}")


def policy_kwargs(args: argparse.Namespace) -> dict:
    """kv_policy and kv_policy_options from --kv-policy, --budget and --kv-policy-options."""
    options = json_object("--kv-policy-options", args.kv_policy_options, '{"sinks": 4}')
    if args.budget is not None:
        options["budget"] = args.budget
    return {"kv_policy": args.kv_policy, "kv_policy_options": options or None}


def engine_kwargs(args: argparse.Namespace) -> dict:
    fraction = args.gpu_memory_utilization
    if fraction is not None and not 0 < fraction <= 0.95:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 0.95] (the share of free memory for the KV cache), "
                          f"got {fraction}; or give --kv-memory SIZE")
    return {
        "model": args.model,
        "kv_cache_memory": parse_size(args.kv_memory) if args.kv_memory else None,
        **({"kv_cache_memory_fraction": args.gpu_memory_utilization} if args.gpu_memory_utilization is not None else {}),
        **format_kwargs(args),
        "kv_layout": args.kv_layout,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "prefill_order": args.prefill_order,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": not args.no_prefix_caching,
        "kv_cache_groups": not args.no_kv_groups,
        "weights": args.weights,
        "device": args.device,
        "speculative": json_object("--speculative", args.speculative, '{"method": "ngram"}') or None,
        **policy_kwargs(args),
        "kv_tiers": args.kv_tiers,
        "preemption_mode": args.preemption_mode,
        "kv_tier_write_through": args.kv_tier_write_through,
        "kv_tier_fsync": not args.no_kv_tier_fsync,
    }
