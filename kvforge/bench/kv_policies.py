"""Decode speed with a KV policy active against the full cache at the same context, in one run.

Every engine prefills the same seeded random prompts (a real prefill, so each policy scores and compacts as it
would serving, kvzip's scoring pass included), then decodes. Rounds time every engine once, the full cache
first, so a noisy machine slows both sides of a ratio alike; ratios are medians of the per-round ratios, in wall
time and in this thread's CPU time (the steadier one on a shared machine). Each policy's row also counts the
timed decode steps that recorded attention weights: where that is 0 decode stayed on the compiled operator.
"""
from __future__ import annotations

import statistics

import torch

from kvforge.bench.timing import Clock, Span
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.errors import ConfigError
from kvforge.kv.formats import get_format
from kvforge.kv.memory import budget_for
from kvforge.kv.policies.base import KVPolicy
from kvforge.progress import Progress
from kvforge.sampling_params import SamplingParams

FULL = "full"
DEFAULT_POLICIES = ("keydiff", "kvzip", "tova", "expected_attention")


class CountingStats:
    """Wraps an Evictor's stats_request: counts the steps that asked for attention weights."""

    def __init__(self, evictor):
        self.inner, self.steps, self.recorded = evictor.stats_request, 0, 0

    def __call__(self, *args, **kwargs):
        stats = self.inner(*args, **kwargs)
        self.steps += 1
        self.recorded += stats is not None
        return stats


def prompts_for(vocab: int, context: int, batch: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(min(100, vocab // 2), vocab, (context,), generator=gen).tolist() for _ in range(batch)]


@torch.inference_mode()
def prefilled_engine(loaded, policy: str | None, budget: float, prompts: list[list[int]], tokens: int,
                     kv_dtype: str = "fp32", block_size: int = 16) -> tuple[LLMEngine, CountingStats | None]:
    """An engine whose sequences have prefilled `prompts` (and, for kvzip, compressed them) and decoded one token."""
    context, batch = len(prompts[0]), len(prompts)
    spec = loaded.config.kv_cache_spec()
    mem = budget_for(spec, get_format(kv_dtype), block_size, context + tokens + 64, batch, 4 * batch)
    options = {"kv_policy": policy, "kv_policy_options": {"budget": budget}} if policy else {}
    engine = LLMEngine(EngineConfig(kv_cache_dtype=kv_dtype, block_size=block_size, max_num_seqs=batch,
                                    kv_cache_memory=mem, max_model_len=context + tokens + 64,
                                    enable_prefix_caching=False, kv_staging_share=1.0, **options), loaded)
    params = SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True)
    seqs = [engine.requests[engine.add_request(p, params)] for p in prompts]
    while any(s.num_computed_tokens < len(s.prompt_token_ids) for s in seqs):
        engine.step()
    engine.step()  # the first decode-shaped step warms up
    evictor = engine.runner.evictor
    counter = None
    if evictor is not None:
        counter = CountingStats(evictor)
        evictor.stats_request = counter
    return engine, counter


def timed_steps(engine: LLMEngine, steps: int) -> Span:
    clock = Clock()
    for _ in range(steps):
        engine.step()
    return clock.split()


def kv_policies_bench(loaded, policies: list[str] | None = None, budget: float = 0.5, context: int = 1024,
                      batch: int = 2, steps: int = 16, rounds: int = 3, seed: int = 0, kv_dtype: str = "fp32",
                      progress: bool = False) -> dict:
    """Per policy: median decode tok/s and its ratio to the full cache's at the same context and batch."""
    policies = list(policies or DEFAULT_POLICIES)
    unknown = [p for p in policies if p not in KVPolicy.registry or p == FULL]
    if unknown:
        allowed = ", ".join(sorted(set(KVPolicy.registry) - {FULL}))
        raise ConfigError(f"bench kv-policies: unknown policies {unknown}; allowed: {allowed}")
    prompts = prompts_for(loaded.config.vocab_size, context, batch, seed)
    tokens = steps * rounds + 2
    built = {FULL: prefilled_engine(loaded, None, budget, prompts, tokens, kv_dtype)}
    bar = Progress("prefill (policy)", len(policies), progress)
    for name in policies:
        built[name] = prefilled_engine(loaded, name, budget, prompts, tokens, kv_dtype)
        bar.update()
    bar.close()
    spans: dict[str, list[Span]] = {label: [] for label in built}
    bar = Progress("decode timing (policy x round)", rounds * len(built), progress)
    for _ in range(rounds):
        for label, (engine, _) in built.items():
            spans[label].append(timed_steps(engine, steps))
            bar.update()
    bar.close()

    def ratio(label: str, of: str) -> float:
        return statistics.median(getattr(b, of) / getattr(t, of) for b, t in zip(spans[FULL], spans[label]))

    rows = {}
    for label, (engine, counter) in built.items():
        rows[label] = {"decode_tok_s": statistics.median(batch * steps / t.wall for t in spans[label]),
                       "speed_vs_full": ratio(label, "wall"), "cpu_speed_vs_full": ratio(label, "cpu"),
                       "cache_tokens": [engine.kv.cache_len(s) for s in engine.scheduler.running],
                       "decode_steps_recording_attention": counter.recorded if counter else 0,
                       "decode_steps_timed": steps * rounds}
    return {"context": context, "batch": batch, "budget": budget, "steps": steps, "rounds": rounds,
            "kv_dtype": kv_dtype, "threads": torch.get_num_threads(), "seed": seed, "policies": rows}
