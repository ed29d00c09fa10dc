"""The benchmarks run end to end on a tiny model and measure what they claim (small workloads)."""
import statistics

import pytest
import torch

from kvforge.bench.flops import engine_bytes, linear_params
from kvforge.bench.memory import memory_bench
from kvforge.bench.prefix import prefix_bench
from kvforge.bench.throughput import throughput_bench
from kvforge.bench.workload import random_workload
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.kv.formats import get_format
from kvforge.kv.memory import bytes_per_token, sequences_that_fit


def test_throughput_counts_the_same_tokens_for_both(tiny_loaded, tiny_dir):
    engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 22, block_size=4, max_model_len=128), tiny_loaded)
    r = throughput_bench(engine, tiny_dir, num_requests=6, prompt_len=(4, 20), output_len=(2, 9), show_progress=False)
    ours, hf, same = r["kvforge"], r["hf"], r["hf_same_allocator"]
    assert ours["output_tokens"] == hf["output_tokens"] == same["output_tokens"] == r["workload"]["output_tokens"]
    for run in (ours, hf, same):
        assert run["output_tok_s"] == pytest.approx(run["output_tokens"] / run["seconds"], rel=1e-12)
    assert r["speedup"] == pytest.approx(ours["output_tok_s"] / hf["output_tok_s"], rel=1e-12)
    assert r["speedup_same_allocator"] == pytest.approx(ours["output_tok_s"] / same["output_tok_s"], rel=1e-12)
    assert r["weights"]["kvforge"] == "fp32" and r["weights"]["kvforge_bytes"] == engine.weight_bytes
    # the FLOPs are the closed form of this workload: every token but each request's last goes through the model
    workload = random_workload(6, (4, 20), (2, 9), tiny_loaded.config.vocab_size, 0)
    lengths = [len(w.prompt_ids) + w.max_tokens - 1 for w in workload]
    cfg, model = tiny_loaded.config, tiny_loaded.model
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * sum(n * (n + 1) // 2 for n in lengths)
    expected = 2 * linear_params(model) * sum(lengths) + 2 * model.lm_head.weight.numel() * r["workload"]["output_tokens"]
    assert ours["flops"] == expected + attention
    peak, bandwidth = r["matmul_peak_gflops"] * 1e9, r["read_bandwidth_gbs"] * 1e9
    assert r["compute_fraction"] == pytest.approx(ours["flops"] / ours["seconds"] / peak, rel=1e-12)
    assert 0 < r["compute_fraction"] <= 1
    # attention read each request's cache once per forward: its prompt, then one more row per decode step
    assert engine.runner.context_rows == sum(sum(range(len(w.prompt_ids), n + 1)) for w, n in zip(workload, lengths))
    passes, rows = engine.runner.forward_passes, engine.runner.context_rows
    weights = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    moved = weights * passes + bytes_per_token(cfg.kv_cache_spec(), get_format("fp32"), 4) * rows
    assert engine_bytes(engine) == moved
    # a sum of per-step maxima lies between the larger and the sum of the two whole-run times
    whole = (ours["flops"] / peak, moved / bandwidth)
    assert max(whole) * (1 - 1e-9) <= ours["roofline_seconds"] <= sum(whole) * (1 + 1e-9)
    assert r["roofline_fraction"] == pytest.approx(ours["roofline_seconds"] / ours["seconds"], rel=1e-12)
    peak, bandwidth = r["matmul_peak_gflops_per_cpu_second"] * 1e9, r["read_bandwidth_gbs_per_cpu_second"] * 1e9
    whole = (ours["flops"] / peak, moved / bandwidth)
    assert max(whole) * (1 - 1e-9) <= ours["roofline_cpu_seconds"] <= sum(whole) * (1 + 1e-9)
    assert r["roofline_fraction_cpu"] == pytest.approx(ours["roofline_cpu_seconds"] / ours["cpu_seconds"], rel=1e-12)


def test_paged_layout_uses_memory_better_than_contiguous(tiny_loaded):
    r = memory_bench(tiny_loaded, num_requests=12, prompt_len=(8, 40), output_len=(4, 16), max_model_len=128,
                     max_num_seqs=12, show_progress=False)
    assert r["paged"]["utilization"] > 0.7  # short sequences: block rounding shows
    assert r["contiguous"]["utilization"] < 0.3
    assert r["concurrency_ratio"] > 1.5


def test_prefix_bench_reuses_the_shared_prompt(tiny_loaded):
    r = prefix_bench(tiny_loaded, num_requests=6, system_len=64, question_len=(4, 12), max_tokens=4, budget=1 << 22,
                     conversations=3, turns=3, show=False)
    assert r["reuse_rate"] > 0.95 and r["multiturn"]["reuse_rate"] > 0.8
    assert r["on"]["hit_tokens"] > 0 == r["off"]["hit_tokens"]
    assert r["peak_kv_reduction"] > 0.3


def test_quantized_formats_fit_more_sequences(tiny_loaded):
    spec = tiny_loaded.config.kv_cache_spec()
    fit = {d: sequences_that_fit(spec, get_format(d), 16, 8 << 20, 256) for d in ("fp32", "fp16", "int8")}
    assert fit["fp16"] == 2 * fit["fp32"] and fit["int8"] >= 1.7 * fit["fp16"]


def test_kv_formats_bench_sweeps_options_with_memory_quality_and_speed(tiny_loaded, monkeypatch):
    from kvforge.bench import kv_formats

    timed = []  # (engine, tokens it decoded, seconds) per timed run, in the bench's order
    real_timed_steps = kv_formats.timed_steps

    def recorded(engine, steps):
        before = engine.generated_tokens
        seconds = real_timed_steps(engine, steps)
        timed.append((engine, engine.generated_tokens - before, seconds))
        return seconds

    monkeypatch.setattr(kv_formats, "timed_steps", recorded)
    specs = ["fp16", "int8", 'int4:{"group_size": 16}', 'int4:{"group_size": 8}']
    ids = torch.randint(0, 96, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    r = kv_formats.kv_formats_bench(tiny_loaded, specs, budget=4 << 20, seq_len=64, batch=2, steps=2, quality_ids=ids, rounds=2)
    rows = r["formats"]
    assert list(rows) == specs and rows["fp16"]["capacity_ratio_vs_fp16"] == 1.0
    assert rows['int4:{"group_size": 8}']["bytes_per_token"] > rows['int4:{"group_size": 16}']["bytes_per_token"]
    assert rows["int8"]["sequences_fit"] > rows["fp16"]["sequences_fit"]
    assert r["quality"]["tokens"] == 48 and abs(rows["fp16"]["delta_pct"]) < 0.1
    labels = ["fp32", *specs]
    assert len(timed) == 2 * len(labels) and all(tokens == 2 * 2 for _, tokens, _ in timed)  # batch x steps decoded
    seconds = {label: [t for i, (_, _, t) in enumerate(timed) if i % len(labels) == j] for j, label in enumerate(labels)}
    assert r["fp32_decode_tok_s"] == pytest.approx(statistics.median(4 / t.wall for t in seconds["fp32"]), rel=1e-12)
    for label, row in rows.items():
        assert row["decode_tok_s"] == pytest.approx(statistics.median(4 / t.wall for t in seconds[label]), rel=1e-12)
        for key, of in (("decode_slowdown_vs_fp32", "wall"), ("decode_cpu_slowdown_vs_fp32", "cpu")):
            slowdown = statistics.median(1 - getattr(f, of) / getattr(t, of) for f, t in zip(seconds["fp32"], seconds[label]))
            assert row[key] == pytest.approx(slowdown, rel=1e-12)
        assert row["ppl"] > 1


def test_spec_bench_compares_the_same_outputs(tiny_loaded):
    from kvforge.bench.spec import spec_bench

    workloads = {"grounded": lambda n: [[5, 6, 7, 8, 9] * 5 + [i] for i in range(n)],
                 "chat": lambda n: [list(range(20 + i, 44 + i)) for i in range(n)]}
    r = spec_bench(tiny_loaded, ["ngram", "ngram_ceiling", "layer_skip", "draft"], batches=(1, 3), prompts_b1=2,
                   max_tokens=12, show=False, workloads=workloads)
    assert r["methods"]["layer_skip"]["layers"] == [1] and r["self_draft"]
    for method in ("ngram", "ngram_ceiling", "layer_skip", "draft"):
        for workload in workloads:
            for key, n in (("b1", 2), ("b3", 3)):
                on, off = r[method][workload][key], r["off"][workload][key]
                assert on["same_output"] and on["output_tokens"] == off["output_tokens"] == 12 * n
                assert on["speedup"] == on["decode_tok_s"] / off["decode_tok_s"]
                assert 1.0 <= on["mean_acceptance_length"] <= 1 + 5 and 0.0 <= on["acceptance_rate"] <= 1.0
                if method == "draft":  # the target drafting for itself accepts everything
                    assert on["acceptance_rate"] == 1.0
                if method == "ngram_ceiling":  # prompt lookup cut to plain decoding's output: all drafts accepted
                    assert on["acceptance_rate"] in (0.0, 1.0)


def test_the_ceiling_cuts_prompt_lookup_where_plain_decoding_departs():
    from kvforge.bench.spec import _CutIndex

    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    index = _CutIndex(2, 4, len(prompt), reference=[3, 1, 9, 9])
    assert index.propose(prompt, 4) == [3, 1]  # lookup offers 3 1 2 3; plain decoding goes 3 1 9
    assert index.propose(prompt + [3, 1], 4) == []  # it offers 2 3 ..., plain decoding says 9
    assert _CutIndex(2, 4, len(prompt), reference=[3]).propose(prompt, 4) == [3]  # no draft past the output's end


def test_verify_cost_fits_a_line_on_each_side_of_the_bridge(tiny_loaded):
    from kvforge.bench.verify_cost import _fit, _spread, planner_constants, regime_rows, verify_cost

    cpu = {1: 1.1, 2: 1.2, 4: 1.4, 8: 1.8, 9: 2.4, 12: 2.7}  # 1 + 0.1 r up to 8 rows, 1.5 + 0.1 r above
    fit = _fit(cpu, 8)
    assert fit["verify_row_cost"] == pytest.approx(0.1) and fit["bridge_jump"] == pytest.approx(0.5)
    assert fit["bridge_row_cost"] == pytest.approx(0.1) and fit["cpu_fixed_ms"] == pytest.approx(1000)
    assert "bridge_jump" not in _fit(cpu, None) and "bridge_jump" not in _fit({1: 1.0, 2: 1.1, 9: 2.0}, 8)
    assert _spread(list("abc"), 2) == (["a", "b"], [0, 0]) and _spread(list("abc"), 8) == (list("abc"), [2, 2, 1])
    assert regime_rows(1) == (1, 2, 4, 6) and regime_rows(2) == (1, 2, 4, 6, 8, 9, 12)
    steps = {"rows8": {"path": "streamed", "cpu_vs_decode": 1.0}, "rows9": {"path": "panels", "cpu_vs_decode": 2.4 / 1.8},
             "rows12": {"path": "panels", "cpu_vs_decode": 2.7 / 1.8}}  # 1.5 + 0.1 r over a plain step of 1 + 0.1 x 8
    constants = planner_constants({"verify_row_cost": 0.1}, {"batch": 8, "steps": steps})
    assert constants == pytest.approx({"verify_row_cost": 0.1, "bridge_jump": 0.5, "bridge_row_cost": 0.1})
    r = verify_cost(tiny_loaded, rounds=1, prompt=list(range(5, 45)), batch=2, rows=(1, 2, 8, 9, 12))
    assert r["steps"]["rows2"]["vs_decode"] == 1.0
    if r["bridge_rows"] is None:
        return  # no compiled layer bridge here: one line
    assert {k: v["path"] for k, v in r["steps"].items()} == {
        "rows1": "streamed", "rows2": "streamed", "rows8": "streamed", "rows9": "panels", "rows12": "panels"}
    assert r["bridge_rows"] == 8 and "bridge_jump" in r


def test_verify_cost_times_every_row_count(tiny_loaded):
    from kvforge.bench.verify_cost import verify_cost

    r = verify_cost(tiny_loaded, ks=(1, 3), rounds=3, prompt=list(range(5, 45)))
    assert r["context_tokens"] == 40 and set(r["steps"]) == {"rows1", "rows2", "rows4"}
    assert r["steps"]["rows1"]["vs_decode"] == 1.0
    assert all(0 < row["lm_head_ms"] < row["ms"] for row in r["steps"].values())


def test_tier_stall_times_every_step_and_tells_decode_only_steps(tiny_loaded):
    from kvforge.bench.tier_stall import step_times, summary

    times, decode_only = step_times(tiny_loaded, None, 6, 2, 8)
    assert len(times) == len(decode_only) == 6 and any(decode_only) and not all(decode_only)
    assert summary(times, decode_only)["steps"] == 6
