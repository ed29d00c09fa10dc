"""kvforge bench: throughput | memory (and more as techniques land)."""
from __future__ import annotations

from kvforge.cli.bench_output import MODEL_HELP, emit, output_options
from kvforge.cli.common import add_engine_options, add_prefill_order, engine_kwargs, parse_size


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks against a baseline in the same run")
    bsub = p.add_subparsers(dest="bench", required=True)

    t = bsub.add_parser("throughput", help="kvforge vs transformers generate on one seeded workload")
    _workload_options(t)
    t.add_argument("--hf-batch-size", type=int, default=None, help="static batch size of the baseline (default: max-num-seqs)")
    t.add_argument("--skip-hf", action="store_true", help="measure kvforge only")
    t.add_argument("--no-same-allocator", action="store_true",
                   help="skip the second transformers run under kvforge's malloc setting")
    add_engine_options(t)
    t.set_defaults(func=run_throughput)

    m = bsub.add_parser("memory", help="paged vs contiguous KV layout under one budget")
    _workload_options(m)
    m.add_argument("--budget", default=None, help="KV budget (default: four contiguous sequences)")
    m.add_argument("--max-model-len", type=int, default=2048, help="longest sequence, prompt + output")
    m.add_argument("--max-num-seqs", type=int, default=64, help="most sequences running at once")
    m.add_argument("--model", default=None, help=MODEL_HELP)
    h = m.add_argument_group("hybrid attention (models with sliding-window layers): KV groups vs every layer kept full")
    h.add_argument("--hybrid-seq-len", type=int, default=4096, help="tokens per sequence, prompt + output")
    h.add_argument("--hybrid-requests", type=int, default=8, help="sequences in the workload")
    h.add_argument("--hybrid-budget-seqs", type=int, default=2,
                   help="KV budget: this many sequences with every layer kept full")
    h.add_argument("--hybrid-output-len", type=int, default=128, help="output tokens of each sequence")
    h.add_argument("--hybrid-chunk", type=int, default=256, help="prefill chunk (max_num_batched_tokens)")
    r = m.add_argument_group("recurrent hybrid (Mamba-2 layers, layer_types): vs its all-attention twin, same width "
                             "and depth (written with random weights)")
    r.add_argument("--vs-attention", action="store_true", help="run this comparison instead of the layout one")
    r.add_argument("--twin-seq-len", type=int, default=8192, help="tokens per sequence, prompt + output")
    r.add_argument("--twin-budget-seqs", type=int, default=2, help="KV budget: this many all-attention sequences")
    r.add_argument("--twin-chunk", type=int, default=2048, help="prefill chunk (max_num_batched_tokens)")
    m.set_defaults(func=run_memory)

    x = bsub.add_parser("prefix", help="shared system prompt and multi-turn chats, prefix caching off vs on")
    x.add_argument("--num-requests", type=int, default=100, help="requests sharing one system prompt")
    x.add_argument("--system-len", type=int, default=2000, help="tokens of the shared system prompt")
    x.add_argument("--question-len", type=int, nargs=2, default=[50, 200], metavar=("MIN", "MAX"),
                   help="tokens of each request's own question, uniform in [MIN, MAX]")
    x.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    x.add_argument("--budget", default="4GiB", help="KV cache budget")
    x.add_argument("--conversations", type=int, default=20, help="multi-turn conversations")
    x.add_argument("--turns", type=int, default=5, help="turns per conversation")
    x.add_argument("--seed", type=int, default=0, help="workload seed")
    x.add_argument("--max-num-seqs", type=int, default=64,
                   help="sequences running at once (a recurrent model keeps a state slot for each)")
    x.add_argument("--state-checkpoint-memory", default=None,
                   help="a recurrent model's state checkpoint budget, taken from --budget (default: 1/8 of it)")
    x.add_argument("--kv-tiers", default=None, metavar="TIER",
                   help="also run the shared-prompt workload in two processes through this tier, the second reusing "
                        "what the first stored: 'disk' (a fresh directory), 'redis' (a private redis-server), "
                        "disk:PATH:SIZE or redis://HOST:PORT (default: none, one process)")
    add_prefill_order(x)
    output_options(x, model=True)
    x.set_defaults(func=run_prefix)

    f = bsub.add_parser("kv-formats", help="bytes/token, 2k-token sequences per budget, decode speed for each format")
    f.add_argument("--formats", nargs="*", default=None,
                   help='format specs, e.g. int8 int4 \'int4:{"group_size": 32}\' (default: every format)')
    f.add_argument("--quality-tokens", type=int, default=0,
                   help="also score perplexity on this many tokens of --text (decode-faithful, vs an fp32 cache)")
    f.add_argument("--text", default="hamlet", help="text for --quality-tokens (as in kvforge eval ppl)")
    f.add_argument("--budget", default="1GiB", help="KV budget for the capacity column")
    f.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence for capacity and decode")
    f.add_argument("--batch", type=int, default=4, help="sequences decoded together")
    f.add_argument("--steps", type=int, default=16, help="decode steps per format per round")
    f.add_argument("--rounds", type=int, default=5, help="rounds of timing, every format once per round (medians)")
    output_options(f, model=True)
    f.set_defaults(func=run_kv_formats)

    sp = bsub.add_parser("spec", help="speculative decoding vs plain decoding on grounded and open-ended prompts")
    sp.add_argument("--methods", nargs="*", default=None, help="drafting methods: ngram ngram_ceiling ngram_fixed ngram_linear layer_skip draft (default: ngram layer_skip, plus draft "
                    "with --draft-model)")
    sp.add_argument("--draft-model", default=None, help="the draft method's model (default: the target itself, "
                    "a correctness check, not a speedup)")
    sp.add_argument("--batches", type=int, nargs="*", default=[1, 8], help="concurrent sequences (default: 1 8)")
    sp.add_argument("--prompts", type=int, default=3, help="prompts run one at a time at batch 1 (default: 3)")
    sp.add_argument("--max-tokens", type=int, default=96, help="tokens generated per prompt (default: 96)")
    sp.add_argument("--passage-tokens", type=int, default=400, help="passage length of grounded prompts (default: 400)")
    sp.add_argument("--texts", nargs="*", default=["hamlet", "macbeth", "gpl-3"],
                    help="texts the grounded passages come from (default: hamlet macbeth gpl-3)")
    sp.add_argument("--spec-options", default=None, help='options for every method as JSON, e.g. \'{"num_speculative_tokens": 8}\' (default: none)')
    sp.add_argument("--rounds", type=int, default=1, help="times each group of prompts runs on every arm, in "
                    "alternating order (default: 1)")
    sp.add_argument("--verify-cost", action="store_true",
                    help="instead: time steps of 1 to batch x 6 rows, both sides of the layer bridge's row limit, "
                         "against a plain decode step, at each of --batches, and fit the planner's verify_row_cost, "
                         "bridge_jump and bridge_row_cost")
    output_options(sp, model=True)
    sp.set_defaults(func=run_spec)

    ti = bsub.add_parser("tiers", help="TTFT by tier (pool, host, disk, redis, recompute), swap vs recompute, two "
                                       "engines on one Redis")
    ti.add_argument("--docs", type=int, default=40, help="distinct documents, each asked twice (default: 40)")
    ti.add_argument("--doc-tokens", type=int, default=2000, help="tokens per document (default: 2000)")
    ti.add_argument("--kv-dtype", default="int8", help="KV format in the pool and every tier (default: int8)")
    ti.add_argument("--pool-docs", type=int, default=3, help="documents the pool holds (default: 3)")
    ti.add_argument("--host-docs", type=int, default=8, help="documents the host tier holds (default: 8)")
    ti.add_argument("--disk-docs", type=int, default=12, help="documents the disk tier holds (default: 12)")
    ti.add_argument("--redis", default=None, help="redis://HOST:PORT[/DB] (default: start a private redis-server)")
    ti.add_argument("--pressure-requests", type=int, default=4,
                    help="concurrent requests of --doc-tokens prompts under memory pressure (default: 4)")
    ti.add_argument("--pressure-output-tokens", type=int, default=64,
                    help="tokens each pressure request generates (default: 64)")
    ti.add_argument("--replica-docs", type=int, default=8, help="documents of the two-engine run (default: 8)")
    ti.add_argument("--seed", type=int, default=0, help="workload seed")
    ti.add_argument("--host-write-modes", action="store_true",
                    help="instead: the host tier written back vs written through (time, hit rate of second asks)")
    output_options(ti, model=True)
    ti.set_defaults(func=run_tiers)

    from kvforge.bench.serve import register_serve
    from kvforge.bench.structured import register_structured
    from kvforge.cli.bench_policies import register_policies
    from kvforge.cli.bench_weights import register_weights
    register_weights(bsub)
    register_policies(bsub)
    register_serve(bsub)
    register_structured(bsub)


def _workload_options(p) -> None:
    p.add_argument("--num-requests", type=int, default=64, help="requests in the seeded workload")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"),
                   help="prompt tokens, uniform in [MIN, MAX]")
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"),
                   help="output tokens, uniform in [MIN, MAX]")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    output_options(p)


def run_throughput(args) -> int:
    from kvforge.bench.throughput import throughput_bench
    from kvforge.config import EngineConfig
    from kvforge.engine.engine import LLMEngine

    options = engine_kwargs(args)
    if options["kv_cache_memory"] is None:
        options["kv_cache_memory"] = 1 << 30
    engine = LLMEngine(EngineConfig(**options))
    result = throughput_bench(engine, engine.loaded.path, args.num_requests, tuple(args.prompt_len), tuple(args.output_len),
                              args.hf_batch_size, args.seed, args.skip_hf, not args.no_progress,
                              not args.no_same_allocator)
    emit(result, args.json, [
        ("kvforge output tok/s", result["kvforge"]["output_tok_s"]),
        ("transformers output tok/s", result.get("hf", {}).get("output_tok_s")),
        ("speedup", result.get("speedup")),
        ("transformers output tok/s, kvforge's malloc setting", result.get("hf_same_allocator", {}).get("output_tok_s")),
        ("speedup, same malloc setting", result.get("speedup_same_allocator")),
        ("roofline fraction (time the roofline allows / time taken)", result["roofline_fraction"]),
        ("roofline fraction per CPU-second of this thread (meaningful at one thread)", result["roofline_fraction_cpu"]),
        ("compute fraction (FLOP/s / matmul peak)", result["compute_fraction"]),
        ("matmul peak GFLOP/s", result["matmul_peak_gflops"]),
        ("read bandwidth GB/s", result["read_bandwidth_gbs"]),
    ])
    return 0


def run_memory(args) -> int:
    from kvforge.bench.memory import memory_bench
    from kvforge.models.loader import load_model

    if args.vs_attention:
        from kvforge.cli.bench_recurrent import run_vs_attention

        return run_vs_attention(args, emit)
    loaded = load_model(args.model)
    budget = parse_size(args.budget) if args.budget else None
    hybrid = {"seq_len": args.hybrid_seq_len, "num_requests": args.hybrid_requests,
              "budget_seqs": args.hybrid_budget_seqs, "output_len": args.hybrid_output_len, "chunk": args.hybrid_chunk}
    result = memory_bench(loaded, args.num_requests, tuple(args.prompt_len), tuple(args.output_len), budget,
                          args.max_model_len, args.max_num_seqs, args.seed, not args.no_progress, hybrid)
    h = result.get("hybrid")
    hybrid_rows = [] if h is None else [
        (f"hybrid: {h['seq_len']}-token sequences that fit, groups / full layers (formula)",
         f'{h["groups"]["sequences_that_fit"]} / {h["full_layers"]["sequences_that_fit"]}'),
        ("hybrid: peak sequences decoding at once, groups / full layers",
         f'{h["groups"]["peak_decoding_seqs"]} / {h["full_layers"]["peak_decoding_seqs"]}'),
        ("hybrid: concurrency ratio", h["concurrency_ratio"]),
        ("hybrid: completion time groups / full layers (s)", f'{h["groups"]["seconds"]:.1f} / {h["full_layers"]["seconds"]:.1f}'),
    ]
    emit(result, args.json, [
        ("paged utilization", result["paged"]["utilization"]),
        ("contiguous utilization", result["contiguous"]["utilization"]),
        ("paged peak concurrent seqs", result["paged"]["peak_concurrent_seqs"]),
        ("contiguous peak concurrent seqs", result["contiguous"]["peak_concurrent_seqs"]),
        ("concurrency ratio", result["concurrency_ratio"]),
        ("completion time paged / contiguous (s)", f'{result["paged"]["seconds"]:.1f} / {result["contiguous"]["seconds"]:.1f}'),
    ] + hybrid_rows)
    return 0


def run_prefix(args) -> int:
    from kvforge.bench.prefix import prefix_bench
    from kvforge.bench.recurrent_model import is_random
    from kvforge.models.loader import load_model

    r = prefix_bench(load_model(args.model), args.num_requests, args.system_len, tuple(args.question_len), args.max_tokens,
                     parse_size(args.budget), args.conversations, args.turns, args.seed, not args.no_progress,
                     args.max_num_seqs, parse_size(args.state_checkpoint_memory) if args.state_checkpoint_memory else None,
                     args.kv_tiers, args.model, args.prefill_order)
    r["random_weights"] = is_random(args.model)
    on, tiers = r["on"], r.get("tiers")
    emit(r, args.json, [
        ("weights", "RANDOM (kvforge.bench.recurrent_model): engine figures only" if r["random_weights"] else None),
        ("outputs identical off / on", r["outputs_identical"]),
        ("state checkpoints stored / hit / evicted", f'{on["state_checkpoints_stored"]} / {on["state_checkpoints_hit"]} / '
         f'{on["state_checkpoints_evicted"]}' if "state_checkpoints_stored" in on else None),
        ("bytes per state checkpoint", on.get("state_checkpoint_bytes")),
        ("hits short of a checkpoint", on.get("prefix_hits_short_of_checkpoint")),
        ("mean TTFT off / on (s)", f'{r["off"]["ttft_mean_s"]:.2f} / {r["on"]["ttft_mean_s"]:.2f}'),
        ("p50 TTFT off / on (s)", f'{r["off"]["ttft_p50_s"]:.2f} / {r["on"]["ttft_p50_s"]:.2f}'),
        ("p99 TTFT off / on (s)", f'{r["off"]["ttft_p99_s"]:.2f} / {r["on"]["ttft_p99_s"]:.2f}'),
        ("total time off / on (s)", f'{r["off"]["total_s"]:.1f} / {r["on"]["total_s"]:.1f}'),
        ("ttft_reduction", r["ttft_reduction"]),
        ("reuse_rate", r["reuse_rate"]),
        ("peak KV bytes off / on", f'{r["off"]["peak_kv_bytes"]} / {r["on"]["peak_kv_bytes"]}'),
        ("peak_kv_reduction", r["peak_kv_reduction"]),
        ("multiturn.reuse_rate", r["multiturn"]["reuse_rate"]),
        *([] if tiers is None else [
            (f"second process through {tiers['tier']}: hit rate", tiers["second_hit_rate"]),
            ("  outputs identical (both processes, caching off)", tiers["outputs_identical"]),
            ("  state checkpoints from the tier", tiers["second"].get("state_checkpoints_from_tiers")),
            ("  mean TTFT first / second process (s)",
             f'{tiers["first"]["ttft_mean_s"]:.2f} / {tiers["second"]["ttft_mean_s"]:.2f}'),
        ]),
    ])
    return 0


def run_tiers(args) -> int:
    from kvforge.bench.tiers import tiers_bench
    from kvforge.models.loader import load_model

    if args.host_write_modes:
        from kvforge.bench.tier_write_modes import host_write_modes

        r = host_write_modes(load_model(args.model), args.docs, args.doc_tokens, args.kv_dtype, args.pool_docs,
                             args.host_docs, args.seed, show=not args.no_progress)
        emit(r, args.json, list(r.items()))
        return 0
    r = tiers_bench(load_model(args.model), args.docs, args.doc_tokens, args.kv_dtype, args.pool_docs, args.host_docs,
                    args.disk_docs, args.redis, pressure_requests=args.pressure_requests,
                    pressure_output_tokens=args.pressure_output_tokens, replica_docs=args.replica_docs, seed=args.seed,
                    show=not args.no_progress)
    ratio = r["ttft_ratio"]
    emit(r, args.json, [
        ("second_pass_hit_rate", r["second_pass_hit_rate"]),
        ("asks by prefix source", r["asks_by_source"]),
        ("mean TTFT by source (s)", {k: round(v, 3) for k, v in r["ttft_mean_s"].items()}),
        *((f"ttft_ratio.{t}", ratio[t]) for t in ratio),
        ("bytes per token by tier", {k: round(v, 1) for k, v in r["bytes_per_token"].items()}),
        ("load GB/s by tier", {k: round(v, 3) for k, v in r["load_gbps"].items()}),
        ("swap_vs_recompute_throughput", r["swap_vs_recompute_throughput"]),
        ("tokens recomputed (recompute / swap)",
         f'{r["pressure"]["recompute"]["tokens_recomputed"]} / {r["pressure"]["swap"]["tokens_recomputed"]}'),
        ("cross_replica_hit_rate", r["cross_replica_hit_rate"]),
        ("cross_replica_ttft_ratio", r["cross_replica_ttft_ratio"]),
    ])
    return 0


def run_spec(args) -> int:
    from kvforge.bench.spec import spec_bench
    from kvforge.models.loader import load_model
    from kvforge.options import json_object

    if args.verify_cost:
        from kvforge.bench.verify_cost import planner_constants, regime_rows, verify_cost

        loaded = load_model(args.model)
        r = {f"b{b}": verify_cost(loaded, batch=b, rows=regime_rows(b)) for b in args.batches}
        if "b1" in r and len(r) > 1:
            r["planner"] = planner_constants(r["b1"], r[f"b{max(args.batches)}"])
        emit(r, args.json, [(f"{key} {name}", (f'{row["ms"]:.1f} ms ({row["vs_decode"]:.2f}x a decode step), CPU '
                                                f'{row["cpu_ms"]:.1f} ms ({row["cpu_vs_decode"]:.2f}x), LM head '
                                                f'{row["lm_head_ms"]:.1f} ms'))
                             for key, c in r.items() if key != "planner" for name, row in c["steps"].items()]
              + [(f"{key} verify_row_cost", (f'{c["verify_row_cost"]:.3f} (CPU {c["cpu_fixed_ms"]:.1f} ms + '
                                             f'{c["cpu_per_row_ms"]:.2f} ms per row)')) for key, c in r.items()
                 if key != "planner"]
              + [(f"{key} bridge_jump, bridge_row_cost", (f'{c["bridge_jump"]:.3f}, {c["bridge_row_cost"]:.3f} (panels '
                                                          f'CPU {c["panels_cpu_fixed_ms"]:.1f} ms + '
                                                          f'{c["panels_cpu_per_row_ms"]:.2f} ms per row)'))
                 for key, c in r.items() if key != "planner" and "bridge_jump" in c]
              + [("planner constants", r["planner"])] * ("planner" in r))
        return 0
    r = spec_bench(load_model(args.model), args.methods, tuple(args.batches), args.prompts, args.max_tokens,
                   args.passage_tokens, not args.no_progress, texts=tuple(args.texts),
                   spec_options=json_object("--spec-options", args.spec_options, '{"num_speculative_tokens": 8}'),
                   draft_model=args.draft_model, rounds=args.rounds)
    rows = []
    for name in r["methods"]:
        for workload, by_batch in r[name].items():
            for key, row in by_batch.items():
                off = r["off"][workload][key]["decode_tok_s"]
                text = (f'decode {off:.1f} -> {row["decode_tok_s"]:.1f} tok/s, speedup {row["speedup"]:.2f} '
                        f'(CPU {row["cpu_speedup"]:.2f}, end to end {row["e2e_speedup"]:.2f}), acceptance '
                        f'{row["acceptance_rate"]:.2f}, mean length {row["mean_acceptance_length"]:.2f}, '
                        f'same output {row["same_output"]}')
                rows.append((f"{name}.{workload}.{key}", text))
    emit(r, args.json, rows)
    return 0


def run_kv_formats(args) -> int:
    from kvforge.bench.kv_formats import kv_formats_bench
    from kvforge.eval.texts import load_text
    from kvforge.models.loader import load_model

    loaded = load_model(args.model)
    ids = loaded.tokenizer.encode(load_text(args.text))[: args.quality_tokens] if args.quality_tokens else None
    r = kv_formats_bench(loaded, args.formats, parse_size(args.budget), args.seq_len, args.batch, args.steps,
                         quality_ids=ids, rounds=args.rounds, progress=not args.no_progress)
    if ids:
        r["quality"]["text"] = args.text
    if args.json:
        emit(r, True, [])
        return 0
    print(f"budget {r['budget_bytes'] / 2**30:.2f} GiB, {r['seq_len']}-token sequences, decode at batch {r['batch']} "
          f"(medians of {r['rounds']} rounds; fp32 {r['fp32_decode_tok_s']:.1f} tok/s)")
    if "quality" in r:
        print(f"perplexity on {r['quality']['tokens']} tokens of {r['quality']['text']}, "
              f"fp32 cache {r['quality']['ppl_baseline']:.4f}")
    width = max(10, *(len(label) for label in r["formats"]))
    print(f"{'format':<{width}} {'B/token':>9} {'seqs fit':>9} {'vs fp16':>8} {'decode tok/s':>13} {'slowdown':>9}"
          + (f" {'ppl delta':>10}" if "quality" in r else ""))
    for label, row in r["formats"].items():
        print(f"{label:<{width}} {row['bytes_per_token']:>9.0f} {row['sequences_fit']:>9} "
              f"{row['capacity_ratio_vs_fp16']:>8.2f} {row['decode_tok_s']:>13.1f} {row['decode_slowdown_vs_fp32']:>8.1%}"
              + (f" {row['delta_pct']:>+9.2f}%" if "quality" in r else ""))
    return 0
