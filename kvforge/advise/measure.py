"""`advise --measure`: run candidate configurations through the engine's own perplexity eval and
throughput bench on the user's model, then filter by loss and rank by the priority."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvforge.advise.inputs import check_format
from kvforge.advise.recommend import Recommendation
from kvforge.errors import ConfigError
from kvforge.kv.memory import bytes_per_token
from kvforge.kv.policies.base import KVPolicy

BALANCED_SCORE = "kv_fraction + 0.2 * max(delta_pct, 0) + 0.5 * max(0, 1 - speed_ratio)   (lower is better)"
BLOCK_SIZE = 16
RULES = {
    "efficiency": "fewest peak KV bytes, then lowest loss",
    "quality": "lowest perplexity increase, then fewest peak KV bytes",
    "balanced": f"lowest score = {BALANCED_SCORE}",
}


@dataclass
class Candidate:
    kv_cache_dtype: str
    kv_policy: str | None = None
    budget: int | float | None = None

    @property
    def name(self) -> str:
        return self.kv_cache_dtype + (f"+{self.kv_policy}:{self.budget}" if self.kv_policy else "")

    def options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"kv_cache_dtype": self.kv_cache_dtype}
        if self.kv_policy:
            opts["kv_policy"] = self.kv_policy
            opts["kv_policy_options"] = {"budget": self.budget, **({"sinks": 4} if self.kv_policy == "streaming" else {})}
        return opts

    def recommendation(self, shared_prefix: bool, block_size: int = 16) -> Recommendation:
        o = self.options()
        return Recommendation(self.kv_cache_dtype, "paged", True, self.kv_policy, o.get("kv_policy_options"),
                              block_size)  # prefix caching: the default, free when unused, whatever shared_prefix


def parse_candidate(text: str) -> Candidate:
    """'int8', 'int4+streaming:512', 'fp16+h2o:0.5' (DTYPE[+POLICY:BUDGET], budget a count or a fraction)."""
    dtype, _, rest = text.strip().partition("+")
    check_format(dtype)
    if not rest:
        return Candidate(dtype)
    policy, _, budget_text = rest.partition(":")
    if policy not in KVPolicy.registry or policy == "full":
        allowed = ", ".join(sorted(set(KVPolicy.registry) - {"full"}))
        raise ConfigError(f"candidate {text!r}: unknown policy {policy!r}; allowed: {allowed}")
    try:
        value = float(budget_text)
    except ValueError:
        raise ConfigError(f"candidate {text!r}: {policy} needs a budget, e.g. {dtype}+{policy}:512") from None
    if value >= 1 and value.is_integer():
        return Candidate(dtype, policy, int(value))
    if 0 < value < 1:
        return Candidate(dtype, policy, value)
    raise ConfigError(f"candidate {text!r}: budget must be a token count >= 1 or a fraction in (0, 1)")


def parse_candidates(text: str) -> list[Candidate]:
    out = [parse_candidate(t) for t in text.split(",") if t.strip()]
    if not out:
        raise ConfigError("--candidates is empty; give e.g. fp16,int8,int4+streaming:512")
    return out


@dataclass
class Row:
    name: str
    kv_cache_dtype: str
    kv_policy: str | None
    kv_bytes_per_token: float  # the format's bytes per cached token (kvforge.kv.memory)
    peak_kv_bytes: int  # KV the engine really held at its peak over the eval text
    kv_fraction: float  # peak_kv_bytes / the fp32 full cache's
    ppl: float
    delta_pct: float  # perplexity increase vs the fp32 full cache, %
    tok_s: float  # output tokens/s on the decode-heavy workload
    speed_ratio: float  # tok_s / fp32's in the same run
    score: float = 0.0
    eligible: bool = True
    rank: int | None = None


@dataclass
class Measurement:
    model: str
    text: str
    tokens: int
    workload: dict[str, Any]
    priority: str
    max_quality_loss: float
    rule: str
    baseline: dict[str, float]
    rows: list[Row]
    choice: str | None
    recommendation: Recommendation | None
    seconds: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rows"] = [asdict(r) for r in self.rows]
        d["recommendation"] = self.recommendation.to_dict() if self.recommendation else None
        return d


def _speed(loaded, workload: list, options: dict[str, Any]) -> float:
    from kvforge.bench.throughput import run_kvforge
    from kvforge.bench.workload import Request
    from kvforge.eval.ppl import engine_for

    tokens = sum(len(r.prompt_ids) + r.max_tokens for r in workload)
    engine = engine_for(loaded, tokens, BLOCK_SIZE, len(workload), **options)
    run_kvforge(engine, [Request(workload[0].prompt_ids[:16], 4)], show_progress=False)  # warm-up
    return run_kvforge(engine, workload, show_progress=False)["output_tok_s"]


def measure(loaded, candidates: list[Candidate], text: str, eval_tokens: int = 1024, priority: str = "balanced",
            max_quality_loss: float = 1.0, chunk_size: int | None = None, requests: int = 4, output_tokens: int = 32,
            shared_prefix: bool = False, seed: int = 0, text_name: str = "", log: Callable[[str], None] | None = None) -> Measurement:
    from kvforge.bench.workload import random_workload
    from kvforge.eval.ppl import engine_for, perplexity

    if eval_tokens < 64:
        raise ConfigError(f"eval_tokens must be >= 64 for a meaningful perplexity, got {eval_tokens}")
    log = log or (lambda s: None)
    t0, cfg = time.perf_counter(), loaded.config
    ids = loaded.tokenizer.encode(text)[:min(eval_tokens, cfg.max_position_embeddings)]
    workload = random_workload(requests, (32, 64), (output_tokens, output_tokens), cfg.vocab_size, seed)
    log(f"fp32 full cache (baseline): perplexity on {len(ids)} tokens, {requests} x {output_tokens} tokens decoded")
    base = perplexity(engine_for(loaded, len(ids), BLOCK_SIZE), ids, chunk_size)
    base_speed = _speed(loaded, workload, {"kv_cache_dtype": "fp32"})
    rows = []
    for c in candidates:
        log(f"{c.name}: perplexity, speed")
        engine = engine_for(loaded, len(ids), BLOCK_SIZE, **c.options())
        r = perplexity(engine, ids, chunk_size)
        tok_s = _speed(loaded, workload, c.options())
        per_token = bytes_per_token(engine.kv_spec, engine.format, engine.kv.block_size)
        rows.append(Row(c.name, c.kv_cache_dtype, c.kv_policy, per_token, r["peak_kv_bytes"], r["peak_kv_bytes"] / base["peak_kv_bytes"], r["ppl"],
                        100.0 * (r["ppl"] - base["ppl"]) / base["ppl"], tok_s, tok_s / base_speed))
    ranked = rank(rows, priority, max_quality_loss)
    choice = next((r for r in ranked if r.rank == 1), None)
    rec = None
    if choice is not None:
        rec = next(c for c in candidates if c.name == choice.name).recommendation(shared_prefix)
    notes = [] if choice else [f"no candidate stays within {max_quality_loss:g}% perplexity increase; "
                               + "keep fp32 or raise --max-quality-loss"]
    notes.append("speeds come from one short run on a shared machine: differences under ~10% are noise")
    baseline = {"ppl": base["ppl"], "peak_kv_bytes": base["peak_kv_bytes"], "tok_s": base_speed}
    load = {"requests": requests, "prompt_len": [32, 64], "output_tokens": output_tokens, "seed": seed}
    return Measurement(loaded.path, text_name, len(ids), load,
                       priority, max_quality_loss, RULES[priority], baseline, ranked, choice.name if choice else None,
                       rec, time.perf_counter() - t0, notes)


def rank(rows: list[Row], priority: str, max_quality_loss: float) -> list[Row]:
    """Eligible rows (delta_pct <= max_quality_loss) ranked by the priority's rule, then the rest unranked."""
    if priority not in RULES:
        raise ConfigError(f"priority must be one of {', '.join(RULES)}, got {priority!r}")
    for r in rows:
        r.score = r.kv_fraction + 0.2 * max(r.delta_pct, 0.0) + 0.5 * max(0.0, 1.0 - r.speed_ratio)
        r.eligible = r.delta_pct <= max_quality_loss
        r.rank = None
    key = {"efficiency": lambda r: (r.peak_kv_bytes, r.delta_pct),
           "quality": lambda r: (r.delta_pct, r.peak_kv_bytes),
           "balanced": lambda r: (r.score, r.delta_pct)}[priority]
    eligible = sorted((r for r in rows if r.eligible), key=key)
    for i, r in enumerate(eligible, 1):
        r.rank = i
    return eligible + sorted((r for r in rows if not r.eligible), key=lambda r: r.delta_pct)
