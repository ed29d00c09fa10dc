"""Shortest-prefill-first admission (engine/prefill_order.py): the split it plans is the optimum, the scheduler
starts requests in that order, nothing waits without bound, and outputs do not depend on the order."""
from __future__ import annotations

import itertools
import random

import pytest

from kvforge import LLM, SamplingParams
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.prefill_order import groups, step_time
from kvforge.errors import ConfigError


def completion_sum(works: list[int], sizes: list[int], fixed: float, cost: float) -> float:
    total, clock, i = 0.0, 0.0, 0
    for size in sizes:
        clock += step_time(sum(works[i:i + size]), fixed, cost)
        total += size * clock
        i += size
    return total


def splits(n: int):
    for cuts in itertools.product([False, True], repeat=n - 1):
        sizes, run = [], 1
        for cut in cuts:
            if cut:
                sizes.append(run)
                run = 1
            else:
                run += 1
        yield sizes + [run]


@pytest.mark.parametrize("seed", range(20))
def test_the_planned_groups_are_the_least_sum_of_completion_times(seed):
    rng = random.Random(seed)
    works = sorted(rng.randint(1, 400) for _ in range(rng.randint(1, 8)))
    fixed, cost = rng.choice([0.5, 1.0, 5.0, 20.0]), rng.choice([0.01, 0.05, 0.2])
    plan = groups(works, 10_000, fixed, cost)
    assert sum(plan) == len(works)
    best = min(completion_sum(works, s, fixed, cost) for s in splits(len(works)))
    assert completion_sum(works, plan, fixed, cost) == pytest.approx(best)


def test_groups_fit_the_step_budget_and_a_longer_request_goes_alone():
    assert groups([10, 10, 10, 10], 25, 100.0, 0.01) == [2, 2]
    assert groups([500, 600], 100, 100.0, 0.01) == [1, 1]


def test_many_short_requests_behind_a_large_fixed_cost_share_a_step_and_long_ones_go_one_by_one():
    assert groups([5] * 10, 2048, 50.0, 0.05) == [10]
    assert groups([340] * 4, 2048, 1.0, 0.05) == [1, 1, 1, 1]


def started(engine: LLMEngine) -> list[str]:
    """Request ids in the order their first step ran."""
    order = []
    while engine.has_unfinished_requests():
        batch = engine.scheduler.schedule()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.num_computed_tokens == 0 and seq.request_id not in order:
                order.append(seq.request_id)
        engine.scheduler.update_from_output(batch)
        for seq in batch.seqs:
            if seq.num_computed_tokens >= seq.num_tokens:
                engine.scheduler.finish(seq)
    return order


def engine_with(smol_loaded, lengths: list[int], **options) -> LLMEngine:
    engine = LLMEngine(EngineConfig(kv_cache_memory="64MiB", max_num_batched_tokens=512, **options), smol_loaded)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for i, n in enumerate(lengths):
        engine.add_request([100 + i] * n, params, request_id=f"r{i}")
    return engine


def test_shortest_first_starts_the_short_prompts_before_the_long_one(smol_loaded):
    lengths = [400, 30, 200, 60]
    assert started(engine_with(smol_loaded, lengths, prefill_order="fcfs")) == ["r0", "r1", "r2", "r3"]
    assert started(engine_with(smol_loaded, lengths, prefill_order="shortest")) == ["r1", "r3", "r2", "r0"]


def test_a_request_overtaken_by_more_than_the_bound_goes_first(smol_loaded):
    lengths = [400] + [100] * 6
    order = started(engine_with(smol_loaded, lengths, prefill_order="shortest", prefill_overtake_tokens=250))
    assert order.index("r0") == 3  # overtaken by 300 tokens (> 250) after three others started


def test_greedy_outputs_do_not_depend_on_the_prefill_order(smol_loaded):
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 20000) for _ in range(rng.randint(5, 300))] for _ in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def outputs(order: str) -> list[list[int]]:
        engine = LLMEngine(EngineConfig(kv_cache_memory="64MiB", max_num_batched_tokens=256, prefill_order=order),
                           smol_loaded)
        return [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, params)]

    assert outputs("shortest") == outputs("fcfs")


@pytest.mark.parametrize("options, message", [({"prefill_order": "lifo"}, "prefill_order must be one of"),
                                               ({"prefill_token_cost": 0}, "prefill_token_cost must be"),
                                               ({"prefill_overtake_tokens": -1}, "prefill_overtake_tokens must be")])
def test_bad_prefill_options_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**options)
