"""`kvforge bench llama-cpp` and `kvforge bench weights`: how kvforge's weight layouts compare, with llama.cpp on the
same GGUF and with each other."""
from __future__ import annotations

from kvforge.cli.bench_output import emit, output_options
from kvforge.config import WEIGHT_KINDS


def register_weights(bsub) -> None:
    ll = bsub.add_parser("llama-cpp", help="kvforge vs llama.cpp (F32 GGUF of the same weights) on batched-bench shapes")
    ll.add_argument("--npp", type=int, default=128, help="prompt tokens per sequence")
    ll.add_argument("--ntg", type=int, default=64, help="generated tokens per sequence (decode steps)")
    ll.add_argument("--npl", type=int, nargs="+", default=[1, 8, 32], help="batch sizes: sequences run together")
    ll.add_argument("--threads", nargs="+", default=None, metavar="N",
                    help="threads of both engines, one run per count: 1,2 or 1 2 (default: torch's thread count)")
    ll.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ll.add_argument("--rounds", type=int, default=3, help="rounds, sides alternating; figures are medians (default: 3)")
    ll.add_argument("--kvforge-only", action="store_true", help="measure kvforge only (no llama-cpp-python needed)")
    ll.add_argument("--llama-gguf", default=None,
                    help="GGUF for llama.cpp as is, e.g. a Q8_0 file (default: an F32 copy of --model, cached)")
    ll.add_argument("--gguf", default=None, metavar="FILE",
                    help="both engines on this GGUF as shipped (llama.cpp reads it as is, kvforge with --weights, "
                         "default auto: its block tensors computed in place); replaces --model and --llama-gguf")
    ll.add_argument("--llama-no-extra-bufts", action="store_true",
                    help="llama.cpp without its repacked weight buffers (AMX, CPU repack), for builds that crash with them")
    ll.add_argument("--weights", default=None, choices=["auto", "fp32", "int8"],
                    help="kvforge's weights (default: fp32, or auto with --gguf)")
    ll.add_argument("--rss-tokens", type=int, default=8192, metavar="N",
                    help="with --gguf: each engine's peak RSS in a fresh process holding an N-token fp16 KV cache "
                         "(default 8192; 0: not measured)")
    output_options(ll, model=True)
    ll.set_defaults(func=run_llama_cpp)

    w = bsub.add_parser("weights", help="two weight kinds (fp32, int8, auto, q8_0, q4_0) side by side: decode tok/s "
                                         "per batch size, resident bytes, perplexity, in one run")
    w.add_argument("--kinds", nargs=2, default=["fp32", "int8"], choices=list(WEIGHT_KINDS),
                   help="the two kinds, baseline first (default: fp32 int8; auto = a GGUF's blocks as stored, "
                        "q8_0 / q4_0 = the fp32 model quantized at load)")
    w.add_argument("--ppl-tokens", type=int, default=512, metavar="N",
                   help="perplexity of each kind on N tokens of --ppl-text, fp32 KV (default 512; 0: not measured)")
    w.add_argument("--ppl-text", default="hamlet", help="a named text (kvforge eval ppl's --text; default hamlet)")
    w.add_argument("--npp", type=int, default=128, help="prompt tokens per sequence")
    w.add_argument("--ntg", type=int, default=64, help="generated tokens per sequence (decode steps)")
    w.add_argument("--npl", type=int, nargs="+", default=[1, 8], help="batch sizes: sequences run together")
    w.add_argument("--rounds", type=int, default=3, help="rounds, each running both kinds (medians reported)")
    w.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    output_options(w, model=True)
    w.set_defaults(func=run_weights)


def run_llama_cpp(args) -> int:
    import torch

    from kvforge.bench.llama_cpp import INSTALL_HINT, llama_cpp_available
    from kvforge.bench.llama_cpp_suite import llama_cpp_suite, parse_threads, summary_rows
    from kvforge.errors import ConfigError
    from kvforge.models.loader import load_model

    threads = parse_threads(args.threads) if args.threads else [torch.get_num_threads()]
    if not args.kvforge_only and not llama_cpp_available():
        raise ConfigError(INSTALL_HINT)
    if args.rss_tokens < 0:
        raise ConfigError(f"--rss-tokens must be >= 0 (0: not measured), got {args.rss_tokens}")
    model, llama_gguf = (args.gguf, args.gguf) if args.gguf else (args.model, args.llama_gguf)
    weights = args.weights or ("auto" if args.gguf else "fp32")
    r = llama_cpp_suite(load_model(model, weights=weights), threads, args.rss_tokens, args.gguf, npp=args.npp,
                        ntg=args.ntg, npl=tuple(args.npl), seed=args.seed, kvforge_only=args.kvforge_only,
                        llama_gguf=llama_gguf, rounds=args.rounds, weights=weights,
                        llama_extra_bufts=not args.llama_no_extra_bufts)
    emit(r, args.json, [("threads", ",".join(map(str, threads)))] + summary_rows(r))
    return 0


def run_weights(args) -> int:
    from kvforge.bench.weights import weights_bench
    from kvforge.errors import ConfigError
    from kvforge.models.loader import load_model

    if args.ppl_tokens < 0 or args.ppl_tokens == 1:
        raise ConfigError(f"--ppl-tokens must be 0 (not measured) or >= 2, got {args.ppl_tokens}")
    r = weights_bench(load_model(args.model), tuple(args.kinds), args.npp, args.ntg, tuple(args.npl), args.rounds,
                      args.seed, args.ppl_tokens, args.ppl_text)
    rows = [(f"{kind} decode tok/s, {pl} seqs", r[kind][f"b{pl}"]["decode_tok_s"]) for kind in r["kinds"]
            for pl in r["npl"]]
    rows += [(f"{kind} decode tok per CPU s, {pl} seqs", r[kind][f"b{pl}"]["decode_tok_per_cpu_s"])
             for kind in r["kinds"] for pl in r["npl"]]
    rows += [(f"{kind} weight bytes", r["weight_bytes"][kind]) for kind in r["kinds"]]
    rows.append(("weight bytes ratio", r["weight_bytes_ratio"]))
    if "perplexity" in r:
        rows += [(f"{kind} perplexity, {r['perplexity']['tokens']} tokens", r["perplexity"]["ppl"][kind])
                 for kind in r["kinds"]]
        rows.append(("perplexity delta %", r["perplexity"]["delta_pct"]))
    emit(r, args.json, rows + [(f"{name}.{k}", v) for name in ("ratio", "ratio_cpu") for k, v in r[name].items()])
    return 0
