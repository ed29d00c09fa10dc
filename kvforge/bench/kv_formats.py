"""KV formats side by side: bytes per token, how many 2k-token sequences fit one budget, decode speed,
and optionally decode-faithful perplexity: memory, quality and speed of each format in one run.

Formats are given as specs, `int4` or `int4:{"group_size": 32}`, so group sizes and windows can be
swept. Decode speed is measured at a fixed context with the cache filled by the format's own write
path (random K/V rows, so no prefill is needed: attention reads the same bytes whatever they hold).
"""
from __future__ import annotations

import statistics

import torch

from kvforge.bench.timing import Clock, Span
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.sequence import SequenceStatus
from kvforge.kv.formats import format_for_model, format_names, get_format, parse_format_spec
from kvforge.kv.memory import budget_for, bytes_per_token, sequences_that_fit, side_bytes
from kvforge.progress import Progress
from kvforge.sampling_params import SamplingParams


@torch.inference_mode()
def fill_synthetic(engine: LLMEngine, context: int, batch: int, seed: int = 0) -> None:
    """Admit `batch` requests whose first context-1 tokens are already in the cache (random K/V)."""
    gen = torch.Generator().manual_seed(seed)
    spec, kv, vocab = engine.kv_spec, engine.kv, engine.model_config.vocab_size
    for b in range(batch):
        prompt = torch.randint(min(100, vocab // 2), vocab, (context,), generator=gen).tolist()  # past special ids
        rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True))
        seq = engine.requests[rid]
        engine.scheduler.waiting.remove(seq)
        kv.allocate_slots(seq, context - 1)
        slots = torch.tensor(kv.slots(seq, 0, context - 1), device=engine.device)
        positions = torch.arange(context - 1, device=engine.device)
        for layer in kv.pool.layers:
            k = torch.randn(context - 1, spec.num_kv_heads, spec.head_dim, generator=gen).to(engine.device)
            v = torch.randn(context - 1, spec.num_kv_heads, spec.v_head_dim, generator=gen).to(engine.device) \
                if spec.has_values else None
            layer.write(slots, k, v, positions)
        seq.num_computed_tokens = context - 1
        seq.status = SequenceStatus.RUNNING
        engine.scheduler.running.append(seq)


def decode_engine(loaded, dtype: str, context: int, batch: int, tokens: int, block_size: int,
                  options: dict | None = None) -> LLMEngine:
    """An engine with `batch` sequences at `context` tokens in the cache, room for `tokens` more each."""
    spec = loaded.config.kv_cache_spec()
    budget = budget_for(spec, format_for_model(dtype, options, loaded.config), block_size, context + tokens + 8, batch, 1)
    engine = LLMEngine(EngineConfig(kv_cache_dtype=dtype, kv_cache_options=options, block_size=block_size,
                                    max_num_seqs=batch, kv_cache_memory=budget, max_model_len=context + tokens + 8,
                                    enable_prefix_caching=False, kv_staging_share=1.0), loaded)  # `batch` windows
    fill_synthetic(engine, context, batch)
    engine.step()  # the last prompt token: first decode-shaped step, warms up
    return engine


def timed_steps(engine: LLMEngine, steps: int) -> Span:
    clock = Clock()
    for _ in range(steps):
        engine.step()
    return clock.split()


def decode_speeds(loaded, specs: dict[str, tuple[str, dict]], context: int, batch: int, steps: int, rounds: int,
                  block_size: int, progress: bool = False) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Median decode tok/s per format, median per-round slowdown vs fp32 in wall time and in this thread's CPU time.

    Every round times each format once, fp32 first, so a noisy machine slows both sides of a ratio alike (the CPU
    time ratio is the steadier one where other processes share the cores).
    """
    engines = {"fp32": decode_engine(loaded, "fp32", context, batch, steps * rounds, block_size)}
    engines.update({label: decode_engine(loaded, name, context, batch, steps * rounds, block_size, opts)
                    for label, (name, opts) in specs.items()})
    spans: dict[str, list[Span]] = {label: [] for label in engines}
    bar = Progress("decode timing (format x round)", rounds * len(engines), progress)
    for _ in range(rounds):
        for label, engine in engines.items():
            spans[label].append(timed_steps(engine, steps))
            bar.update()
    bar.close()
    tok_s = {label: statistics.median(batch * steps / t.wall for t in ts) for label, ts in spans.items()}

    def slowdown(of: str) -> dict[str, float]:
        base = [getattr(t, of) for t in spans["fp32"]]
        return {label: statistics.median(1 - f / getattr(t, of) for f, t in zip(base, ts)) for label, ts in spans.items()}

    return tok_s, slowdown("wall"), slowdown("cpu")


def perplexities(loaded, specs: dict[str, tuple[str, dict]], ids: list[int],
                 progress: bool = False) -> tuple[float, dict[str, float]]:
    """fp32-cache baseline and each format's decode-faithful perplexity on ids (as kvforge eval ppl scores)."""
    from kvforge.eval.ppl import engine_for, perplexity

    base = perplexity(engine_for(loaded, len(ids)), ids, progress="perplexity, fp32" if progress else None)["ppl"]
    ppl = {label: perplexity(engine_for(loaded, len(ids), kv_cache_dtype=name, kv_cache_options=opts), ids,
                             progress=f"perplexity, {label}" if progress else None)["ppl"]
           for label, (name, opts) in specs.items()}
    return base, ppl


def kv_formats_bench(loaded, formats: list[str] | None = None, budget: int = 1 << 30, seq_len: int = 2048,
                     batch: int = 4, steps: int = 16, block_size: int = 16, quality_ids: list[int] | None = None,
                     rounds: int = 5, progress: bool = False) -> dict:
    spec = loaded.config.kv_cache_spec()
    specs = {text: parse_format_spec(text) for text in (formats or format_names())}
    base16 = sequences_that_fit(spec, get_format("fp16"), block_size, budget, seq_len)
    tok_s, slowdown, cpu_slowdown = decode_speeds(loaded, specs, seq_len, batch, steps, rounds, block_size, progress)
    rows = {}
    for label, (name, opts) in specs.items():
        fmt = format_for_model(name, opts, loaded.config)
        fit = sequences_that_fit(spec, fmt, block_size, budget, seq_len)
        rows[label] = {"bytes_per_token": bytes_per_token(spec, fmt, block_size),
                       "side_bytes_per_seq": side_bytes(spec, fmt, block_size, 1),
                       "sequences_fit": fit, "capacity_ratio_vs_fp16": fit / base16,
                       "decode_tok_s": tok_s[label], "decode_slowdown_vs_fp32": slowdown[label],
                       "decode_cpu_slowdown_vs_fp32": cpu_slowdown[label]}
    result = {"budget_bytes": budget, "seq_len": seq_len, "batch": batch, "decode_steps": steps, "rounds": rounds,
              "threads": torch.get_num_threads(), "fp16_sequences_fit": base16, "fp32_decode_tok_s": tok_s["fp32"],
              "formats": rows}
    if quality_ids:
        base, ppl = perplexities(loaded, specs, quality_ids, progress)
        result["quality"] = {"tokens": len(quality_ids), "ppl_baseline": base}
        for label, p in ppl.items():
            rows[label]["ppl"] = p
            rows[label]["delta_pct"] = 100 * (p - base) / base
    return result
