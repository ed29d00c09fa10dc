"""The selection tree: context length -> attention kind -> efficiency need -> loss tolerance -> fit ->
prefix sharing -> layout, each answered from a flag, the model's config, or memcalc."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvforge.advise.inputs import AdviseInputs
from kvforge.advise.recommend import MemoryConsequence, Recommendation, fits, memory_line, tokens_that_fit
from kvforge.errors import ConfigError, KVForgeError
from kvforge.kv.formats import get_format
from kvforge.kv.policies.base import KVPolicy
from kvforge.memcalc import ResolvedModel, default_weights, memory_report, resolve_model

LONG_CONTEXT = 32 * 1024
STREAMING_BUDGET = 4096  # StreamingLLM's cache when memory does not ask for less
MIN_CACHE = 256
# Perplexity increase (%) of each format vs the fp32 cache: the project's measurement in docs/results.md
# ("KV formats", the Hamlet column: `kvforge eval ppl --kv-dtype D --max-tokens 4096`, SmolLM2-135M).
# A prior only; `advise --measure` measures the user's own model. A test keeps this equal to docs/results.json.
PRIOR_LOSS = {"fp32": 0.0, "fp16": 0.0, "bf16": 0.01, "fp8_e4m3": 0.74, "fp8_e5m2": 3.39, "int8": 0.11, "int4": 0.41,
              "kivi2": 3.21}
PRIOR_SOURCE = "measured on SmolLM2-135M, 4,096 tokens of Hamlet (docs/results.md)"
LADDER = ("fp16", "int8", "int4", "kivi2")  # each rung smaller and lossier than the last
MLA_LADDER = ("fp16", "int8")
POLICY_NAMES = {"streaming": "StreamingLLM", "snapkv": "SnapKV", "h2o": "H2O"}


@dataclass
class Step:
    question: str
    answer: str
    source: str  # "flag --x", "model config", "default", "memcalc"
    detail: str = ""


@dataclass
class Advice:
    model: str
    attention_kind: str
    inputs: AdviseInputs
    path: list[Step]
    recommendation: Recommendation
    memory: MemoryConsequence
    notes: list[str] = field(default_factory=list)

    @property
    def outcome(self) -> str:
        """The techniques in one line, e.g. 'GQA + paged + int8 + prefix sharing'."""
        r = self.recommendation
        parts = [self.attention_kind, r.kv_layout, r.kv_cache_dtype]
        if r.enable_prefix_caching and self.inputs.shared_prefix and not r.kv_policy:
            parts.append("prefix sharing")
        if r.kv_policy:
            parts.append(f"{POLICY_NAMES.get(r.kv_policy, r.kv_policy)} ({r.kv_policy_options['budget']:,} tokens)")
        return " + ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {"model": self.model, "attention_kind": self.attention_kind, "outcome": self.outcome,
                "inputs": self.inputs.to_dict(),
                "path": [asdict(s) for s in self.path], "recommendation": self.recommendation.to_dict(),
                "memory": self.memory.to_dict(), "notes": self.notes}


def _weights(m: ResolvedModel, inputs: AdviseInputs) -> tuple[int, str]:
    return default_weights(m, inputs.weights_dtype)


def _usable(m: ResolvedModel, name: str, block_size: int) -> bool:
    try:
        get_format(name).validate(m.config.kv_cache_spec(), block_size)
        return True
    except KVForgeError:
        return False


def advise(inputs: AdviseInputs) -> Advice:
    m = resolve_model(inputs.model)
    cfg, path, notes = m.config, [], []
    model_ctx = cfg.max_position_embeddings
    weights, weights_source = _weights(m, inputs)
    mem, batch, bs = inputs.memory, inputs.batch, inputs.block_size

    # 1. context
    context = model_ctx if inputs.unbounded else inputs.context or min(model_ctx, 4096)
    source = "flag --context" if inputs.context != 0 else "default: min(model context, 4096)"
    shown = "unbounded" if inputs.unbounded else f"{context:,} tokens"
    long = inputs.unbounded or context >= LONG_CONTEXT
    path.append(Step("Is the typical context under 32K tokens?", "no" if long else "yes", source, shown))
    beyond = inputs.unbounded or context > model_ctx
    if long:
        path.append(Step(f"Must sequences run past the model's trained context ({model_ctx:,} tokens)?",
                         "yes" if beyond else "no", "model config + --context",
                         "only StreamingLLM keeps RoPE positions inside a bounded cache" if beyond
                         else "a full cache stays correct; it just grows with the context"))
    cached = min(context, model_ctx) if not beyond else min(model_ctx, STREAMING_BUDGET)

    # 2. attention kind
    kind = cfg.attention_kind
    ratio = memory_report(m, seq_len=min(context, model_ctx), kv_dtype="fp16", block_size=bs).mha_ratio
    kind_detail = {
        "MLA": f"latent cache is {ratio:.1%} of MHA; keep it at >= 8 bits: every head decodes from the one latent",
        "GQA": f"{cfg.num_heads} query heads share {cfg.num_kv_heads} KV heads: {ratio:.1%} of MHA already",
        "MQA": f"one KV head for {cfg.num_heads} query heads: {ratio:.1%} of MHA already",
        "MHA": "every head caches its own K/V; only the storage format and eviction can shrink it",
    }[kind]
    path.append(Step("Which attention does the model use?", kind, "model config", kind_detail))
    ladder = tuple(f for f in (MLA_LADDER if kind == "MLA" else LADDER) if _usable(m, f, bs))

    # 3. efficiency
    tight = not fits(m, "int8", cached, batch, bs, mem, weights)
    extreme = inputs.priority == "efficiency" or tight
    if inputs.priority == "efficiency":
        why, src = "priority efficiency", "flag --priority"
    elif tight:
        why, src = f"an int8 cache of {batch} x {cached:,} tokens does not fit in --memory", "memcalc"
    else:
        why = f"priority {inputs.priority}" + (f"; int8 for {batch} x {cached:,} tokens fits" if mem else "")
        src = "flag --priority" if mem is None else "flag --priority + memcalc"
    path.append(Step("Is extreme efficiency needed?", "yes" if extreme else "no", src, why))

    # 4. loss tolerance -> format
    tol = inputs.tolerance
    allowed = [f for f in ladder if PRIOR_LOSS[f] <= tol] if tol > 0 else []  # 0: exact fp32, not rounded fp16
    src = "flag --max-quality-loss" if inputs.max_quality_loss is not None else f"default of priority {inputs.priority}"
    path.append(Step("Can some quality loss be tolerated?", f"yes, up to {tol:g}%" if tol > 0 else "no", src,
                     "allowed: " + (", ".join(f"{f} (+{PRIOR_LOSS[f]:g}%)" for f in allowed) or "fp32 only")
                     + f"; losses {PRIOR_SOURCE}"))
    if not allowed:
        dtype = "fp32"
    elif extreme:
        dtype = allowed[-1]
    elif inputs.priority == "quality":
        dtype = allowed[0]
    else:
        dtype = "int8" if "int8" in allowed else allowed[-1]

    # 5. fit (with --memory): a smaller rung, then eviction
    policy, budget = ("streaming", cached) if beyond else (None, None)
    if mem is not None:
        ok = fits(m, dtype, cached, batch, bs, mem, weights)
        while not ok and dtype in allowed and allowed.index(dtype) + 1 < len(allowed):
            dtype = allowed[allowed.index(dtype) + 1]
            ok = fits(m, dtype, cached, batch, bs, mem, weights)
        answer = "yes" if ok else "no"
        if not ok:
            room = tokens_that_fit(m, dtype, batch, bs, mem, weights)
            if room - KVPolicy.slack - bs < MIN_CACHE:
                raise ConfigError(f"{batch} sequence(s) of even {MIN_CACHE} tokens in {dtype} do not fit in "
                                  f"{mem:,} bytes after {weights:,} bytes of weights; lower --batch or add memory")
            budget = room - KVPolicy.slack - bs  # the cache grows by `slack` tokens past budget before compacting
            policy = policy or ("snapkv" if long else "h2o")
            answer = f"no: keep {budget:,} tokens per sequence with {policy}"
        path.append(Step(f"Does {dtype} for {batch} x {cached:,} tokens fit in memory?", answer, "memcalc",
                         f"{mem:,} B minus {weights:,} B of weights"))
    if policy and not inputs.unbounded and policy != "streaming":
        notes.append(f"{policy} drops tokens: the loss is not in the format prior; check it with --measure")

    # 6. prefix sharing
    # prefix caching stays on (the default) either way: unused, it costs nothing; never advise turning it off
    evicts = policy is not None
    detail = ("eviction rewrites a sequence's blocks, so the engine shares none of them (it needs no flag for that)"
              if evicts else "blocks of a shared system prompt / earlier turns are reused, not recomputed or stored "
              "twice" if inputs.shared_prefix else "nothing to share now; prefix caching stays on, it costs nothing "
              "unused")
    path.append(Step("Does the workload share prefixes (system prompts, multi-turn)?",
                     "yes" if inputs.shared_prefix else "no", "flag --shared-prefix", detail))

    # 7. layout
    path.append(Step("Paged or contiguous cache?", "paged", "rule",
                     "blocks are allocated as sequences grow; prefix sharing and eviction need blocks"))
    options = {"budget": budget, **({"sinks": 4} if policy == "streaming" else {})} if policy else None
    rec = Recommendation(dtype, "paged", True, policy, options, bs)
    return Advice(m.name, kind, inputs, path, rec, _consequence(m, rec, context, beyond, weights, inputs, weights_source), notes)


def _consequence(m: ResolvedModel, rec: Recommendation, context: int, beyond: bool, weights: int,
                 inputs: AdviseInputs, weights_source: str) -> MemoryConsequence:
    model_ctx = m.config.max_position_embeddings
    full = min(context, model_ctx)
    mem, bs = inputs.memory, inputs.block_size
    kept = min(full if not beyond else context, rec.cached_tokens_cap or full)
    lines = [memory_line(m, "fp32 full cache (engine default)", "fp32", full, bs, mem, weights),
             memory_line(m, "fp16 full cache", "fp16", full, bs, mem, weights),
             memory_line(m, f"recommended: {rec.label}", rec.kv_cache_dtype, kept, bs, mem, weights)]
    budget = None if mem is None else max(mem - weights, 0)
    return MemoryConsequence(full, weights if mem is not None else None, budget, lines,
                             weights_source if mem is not None else None)
