"""What a verification step costs: one forward of R rows against a plain decode step of batch rows.

`batch` sequences hold grounded prompts in their cache; each round times the model's forward and LM head for
plain decode steps and verification steps where the sequences carry drafts (copies of their last token, all
rejected, never committed), every step size once, in alternating order. Medians of the rounds are reported, in
wall time and in CPU time of the thread (`time.thread_time`, steadier on a shared machine), with the LM head's
share split out, plus least-squares lines step_cpu = fixed + per_row * rows: the cost model of the adaptive
speculation planner (engine/step_cost.py). Where the layer bridge serves the model, steps of up to
BRIDGE_ROWS rows (weights streamed once for all rows) and larger ones (panel tiles) get a line each
(verify_row_cost = per_row / fixed of the first; bridge_jump and bridge_row_cost place the second in the same
unit); else one line over every size.
"""
from __future__ import annotations

import statistics
import time

import torch

from kvforge.bench.spec import grounded_prompts
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.scheduler import ScheduledBatch
from kvforge.errors import ConfigError
from kvforge.ops.layer_bridge import BRIDGE_ROWS
from kvforge.sampling_params import SamplingParams


def verify_cost(loaded, ks: tuple[int, ...] = (1, 3, 5), rounds: int = 9, passage_tokens: int = 400,
                prompt: list[int] | None = None, batch: int = 1, rows: tuple[int, ...] | None = None) -> dict:
    """prompt: the cached context of every sequence (default: grounded prompts of passage_tokens); rows: the step
    sizes timed (default batch x (1 + k) for k in 0 and ks); a step of R < batch rows decodes R of the sequences, one
    of R >= batch rows gives the batch R - batch drafts, spread evenly."""
    sizes = sorted(set(rows or (batch * (1 + k) for k in (0, *ks))))
    if sizes[0] < 1:
        raise ConfigError(f"verify cost: step sizes must be >= 1 row, got {sizes}")
    depth = max(1, -(-(sizes[-1] - batch) // batch))
    engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 30, max_num_seqs=batch, enable_prefix_caching=False,
                                    speculative={"method": "ngram", "num_speculative_tokens": depth}), loaded)
    prompts = [prompt] * batch if prompt else grounded_prompts(loaded.tokenizer, batch, passage_tokens)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=64))
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (and a first decode for the sequences prefilled first)
    seqs, runner, model = list(engine.scheduler.running), engine.runner, loaded.model
    times: dict[int, list[tuple[float, float, float]]] = {r: [] for r in sizes}
    for r in range(rounds):
        for size in sizes if r % 2 == 0 else sizes[::-1]:
            step_seqs, drafts = _spread(seqs, size)
            step = ScheduledBatch(step_seqs, [1 + k for k in drafts],
                                  draft_token_ids={s.request_id: [s.token_ids[-1]] * k for s, k in zip(step_seqs, drafts) if k})
            for seq, k in zip(step_seqs, drafts):
                engine.kv.allocate_slots(seq, 1 + k)
            with torch.inference_mode():
                ids, meta, out_rows = runner.build_metadata(step)
                start, cpu = time.perf_counter(), time.thread_time()
                hidden = model(ids, meta, engine.kv.pool)
                body = time.perf_counter()
                model.compute_logits(hidden[out_rows]).float().argmax(-1).tolist()
                times[size].append((time.perf_counter() - start, time.perf_counter() - body, time.thread_time() - cpu))
    plain = batch if batch in times else sizes[0]
    base = statistics.median(w for w, _, _ in times[plain])
    base_cpu = statistics.median(c for _, _, c in times[plain])
    limit = runner.bridge_rows()
    steps = {f"rows{size}": {"ms": 1e3 * statistics.median(w for w, _, _ in t),
                             "lm_head_ms": 1e3 * statistics.median(h for _, h, _ in t),
                             "cpu_ms": 1e3 * statistics.median(c for _, _, c in t),
                             "vs_decode": statistics.median(w for w, _, _ in t) / base,
                             "cpu_vs_decode": statistics.median(c for _, _, c in t) / base_cpu,
                             "path": "streamed" if limit is not None and size <= limit else "panels"}
             for size, t in times.items()}
    cpu = {size: statistics.median(c for _, _, c in t) for size, t in times.items()}
    return {"batch": batch, "context_tokens": min(s.num_computed_tokens for s in seqs), "rounds": rounds,
            "bridge_rows": limit, "steps": steps, **_fit(cpu, limit)}


def regime_rows(batch: int, drafts: int = 5) -> tuple[int, ...]:
    """Step sizes that show both sides of the layer bridge's limit at this batch: single rows of up to BRIDGE_ROWS
    sequences, the limit and just past it, and the batch with 0, 1, 3 and `drafts` drafts each."""
    near = (1, 2, BRIDGE_ROWS // 2, BRIDGE_ROWS - 2, BRIDGE_ROWS, BRIDGE_ROWS + 1, BRIDGE_ROWS + 4)
    most = batch * (1 + drafts)
    return tuple(sorted({r for r in near if r <= most} | {batch * (1 + k) for k in (0, 1, 3, drafts)}))


def _spread(seqs: list, size: int) -> tuple[list, list[int]]:
    """The sequences of a step of `size` rows and each one's drafts."""
    if size <= len(seqs):
        return seqs[:size], [0] * size
    extra, n = size - len(seqs), len(seqs)
    return seqs, [extra // n + (i < extra % n) for i in range(n)]


def _fit(cpu: dict[int, float], limit: int | None) -> dict:
    """The planner's step cost from CPU seconds by step size: one line over every size, and where the bridge serves,
    a line over the bridged sizes (fixed + per_row x rows) and one over the larger ones; the constants in units of the
    bridged line's fixed cost (verify_row_cost; bridge_jump, bridge_row_cost: engine/step_cost.py)."""
    fixed, per_row = _line(list(cpu), list(cpu.values()))
    out = {"cpu_fixed_ms": 1e3 * fixed, "cpu_per_row_ms": 1e3 * per_row,
           "verify_row_cost": per_row / fixed if fixed > 0 else float("inf")}
    below = {r: c for r, c in cpu.items() if limit is not None and r <= limit}
    above = {r: c for r, c in cpu.items() if r not in below}
    if len(below) < 2 or len(above) < 2:
        return out
    f1, s1 = _line(list(below), list(below.values()))
    f2, s2 = _line(list(above), list(above.values()))
    if f1 <= 0:
        return out
    return {**out, "cpu_fixed_ms": 1e3 * f1, "cpu_per_row_ms": 1e3 * s1, "verify_row_cost": s1 / f1,
            "panels_cpu_fixed_ms": 1e3 * f2, "panels_cpu_per_row_ms": 1e3 * s2,
            "bridge_jump": (f2 - f1) / f1, "bridge_row_cost": s2 / f1}


def planner_constants(single: dict, batch: dict) -> dict:
    """The planner's three constants from a batch-1 run (`single`: verify_row_cost, what a draft row adds to one
    sequence's step) and a larger batch's run (`batch`): bridge_jump and bridge_row_cost such that a panel step of R
    rows costs what was measured relative to that batch's plain (bridged) step, priced 1 + verify_row_cost x batch."""
    c, plain = single["verify_row_cost"], 1 + single["verify_row_cost"] * batch["batch"]
    above = {int(name[4:]): row["cpu_vs_decode"] * plain for name, row in batch["steps"].items()
             if row["path"] == "panels"}
    if len(above) < 2:
        return {"verify_row_cost": c}
    fixed, per_row = _line(list(above), list(above.values()))
    return {"verify_row_cost": c, "bridge_jump": max(0.0, fixed - 1), "bridge_row_cost": max(0.0, per_row)}


def _line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope of ys over xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope
