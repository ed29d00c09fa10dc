"""What a verification step costs: one forward of batch x (1 + k) rows against a plain decode step of batch rows.

`batch` sequences hold grounded prompts in their cache; each round times execute() of a plain decode step and
of verification steps where every sequence carries k drafts (copies of its last token, all rejected, never
committed), in alternating order. Medians of the rounds are reported, in wall time and in CPU time of the
thread (`time.thread_time`, steadier on a shared machine), with the LM head's share split out, plus the
least-squares line step_cpu = fixed + per_row * rows over the measured row counts: the cost model of the
adaptive speculation planner (`verify_row_cost` = per_row / fixed, see engine/spec/planner.py).
"""
from __future__ import annotations

import statistics
import time

import torch

from kvforge.bench.spec import grounded_prompts
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.scheduler import ScheduledBatch
from kvforge.sampling_params import SamplingParams


def verify_cost(loaded, ks: tuple[int, ...] = (1, 3, 5), rounds: int = 9, passage_tokens: int = 400,
                prompt: list[int] | None = None, batch: int = 1) -> dict:
    """prompt: the cached context of every sequence (default: grounded prompts of passage_tokens)."""
    engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 30, max_num_seqs=batch, enable_prefix_caching=False,
                                    speculative={"method": "ngram", "num_speculative_tokens": max(ks)}), loaded)
    prompts = [prompt] * batch if prompt else grounded_prompts(loaded.tokenizer, batch, passage_tokens)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=64))
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (and a first decode for the sequences prefilled first)
    seqs, runner, model = list(engine.scheduler.running), engine.runner, loaded.model
    times: dict[int, list[tuple[float, float, float]]] = {k: [] for k in (0, *ks)}
    for r in range(rounds):
        for k in (0, *ks) if r % 2 == 0 else (*ks, 0)[::-1]:
            for seq in seqs:
                seq.draft_token_ids = [seq.token_ids[-1]] * k
                engine.kv.allocate_slots(seq, 1 + k)
            with torch.inference_mode():
                ids, meta, rows = runner.build_metadata(ScheduledBatch(seqs, [1 + k] * len(seqs)))
                start, cpu = time.perf_counter(), time.thread_time()
                hidden = model(ids, meta, engine.kv.pool)
                body = time.perf_counter()
                model.compute_logits(hidden[rows]).float().argmax(-1).tolist()
                times[k].append((time.perf_counter() - start, time.perf_counter() - body, time.thread_time() - cpu))
    for seq in seqs:
        seq.draft_token_ids = []
    base = statistics.median(w for w, _, _ in times[0])
    base_cpu = statistics.median(c for _, _, c in times[0])
    steps = {f"rows{batch * (1 + k)}": {"ms": 1e3 * statistics.median(w for w, _, _ in t),
                                        "lm_head_ms": 1e3 * statistics.median(h for _, h, _ in t),
                                        "cpu_ms": 1e3 * statistics.median(c for _, _, c in t),
                                        "vs_decode": statistics.median(w for w, _, _ in t) / base,
                                        "cpu_vs_decode": statistics.median(c for _, _, c in t) / base_cpu}
             for k, t in times.items()}
    fixed, per_row = _line([batch * (1 + k) for k in times], [statistics.median(c for _, _, c in t)
                                                              for t in times.values()])
    return {"batch": batch, "context_tokens": min(s.num_computed_tokens for s in seqs), "rounds": rounds,
            "steps": steps, "cpu_fixed_ms": 1e3 * fixed, "cpu_per_row_ms": 1e3 * per_row,
            "verify_row_cost": per_row / fixed if fixed > 0 else float("inf")}


def _line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope of ys over xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope
