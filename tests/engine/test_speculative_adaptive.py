"""Adaptive speculation: the planner's per-sequence acceptance, probes and batch cost; lossless with it on."""
import pytest
from test_speculative import PROMPTS, make, run

from kvforge.config import EngineConfig
from kvforge.engine.speculative.planner import PRIOR_ACCEPTANCE, Candidate, SpeculationPlanner
from kvforge.errors import ConfigError


def planner(row_cost=0.05, probe=2, max_probe=8):
    return SpeculationPlanner(row_cost, smoothing=0.5, probe_interval=probe, max_probe_interval=max_probe)


def step(p, key="a", drafts=5, decoding=1):
    return p.plan([Candidate(key, drafts)], decoding)[key]


def test_a_fresh_sequence_alone_drafts_all_it_can_when_rows_are_cheap():
    p = planner(row_cost=0.01)
    assert step(p) == 5 and p.states["a"].rate == PRIOR_ACCEPTANCE
    p.record("a", 5, 5)
    assert p.states["a"].rate == pytest.approx(1 - 0.5 ** 6)


def test_low_acceptance_turns_a_sequence_off_and_it_probes_with_growing_backoff():
    p = planner(row_cost=0.05, probe=2, max_probe=8)
    for _ in range(5):
        p.record("a", 1, 0)  # rate 0.5 -> 0.5**6
    assert p.states["a"].rate < 0.05 / 1.05
    plans = [step(p) for _ in range(3)]
    assert plans == [0, 0, 1]  # off for probe_interval steps, then one probe token
    assert p.num_skipped_low_acceptance == 2 and p.num_probes == 1 and p.num_skipped_batch_cost == 0
    p.record("a", 1, 0)  # the probe failed: the wait doubles
    assert [step(p) for _ in range(5)] == [0, 0, 0, 0, 1]
    p.record("a", 1, 0)
    assert [step(p) for _ in range(9)] == [0] * 8 + [1]
    p.record("a", 1, 0)
    assert [step(p) for _ in range(9)] == [0] * 8 + [1]  # capped at max_probe_interval
    p.record("a", 1, 1)  # the text turned repetitive: the probe is accepted, drafting resumes
    p.record("a", 1, 1)
    assert step(p) > 0 and p.states["a"].backoff == 2


def test_the_batch_cost_model_gives_drafts_only_where_they_pay():
    """row_cost 0.5: alone, a step of 1 row costs 1.5 for 1 token; a first draft at rate 0.5 costs 2 for 1.5
    expected tokens (better), a second draft 2.5 for 1.75 (worse). Four decoding rows cost 3 for 4 tokens; one
    draft would cost 3.5 for 4.5 (worse), so none of the four drafts."""
    p = planner(row_cost=0.5, probe=100, max_probe=100)
    assert step(p) == 1
    p.retain(set())
    keys = ["a", "b", "c", "d"]
    plan = p.plan([Candidate(k, 5) for k in keys], 4)
    assert plan == {k: 0 for k in keys}
    assert p.num_skipped_batch_cost == 4 and p.num_skipped_low_acceptance == 0


def test_the_best_sequences_draft_first_and_larger_batches_draft_less():
    p = planner(row_cost=0.05, probe=100, max_probe=100)
    rates = {"hi": 0.9, "mid": 0.6, "lo": 0.1}
    totals = []
    for decoding in (1, 3, 8, 16, 32):
        p.retain(set())
        for k, r in rates.items():
            p.state(k).rate = r
        plan = p.plan([Candidate(k, 5) for k in rates], decoding)
        assert plan["hi"] >= plan["mid"] >= plan["lo"]
        totals.append(sum(plan.values()))
    assert totals == sorted(totals, reverse=True) and totals[0] > totals[-1]


def test_a_planned_draft_never_exceeds_what_the_candidate_offers():
    p = planner(row_cost=0.0)
    assert p.plan([Candidate("a", 3), Candidate("b", 0)], 2) == {"a": 3, "b": 0}
    assert p.num_skipped_low_acceptance == p.num_skipped_batch_cost == 0 and "b" not in p.states


def test_greedy_output_is_identical_with_adaptivity_at_batch_4(tiny_loaded):
    """Expensive rows make the planner trim and switch off sequences; output stays token-identical."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "verify_row_cost": 0.3,
            "probe_interval": 1}
    off = run(make(tiny_loaded, None))
    engine = make(tiny_loaded, spec)
    assert [o.token_ids for o in run(engine)] == [o.token_ids for o in off]
    s = engine.stats()
    assert s["spec_num_accepted_tokens"] > 0 and s["spec_num_trimmed_draft_tokens"] > 0
    assert s["spec_num_skipped_batch_cost"] + s["spec_num_skipped_low_acceptance"] > 0 and s["spec_num_probes"] > 0
    fixed = make(tiny_loaded, {**spec, "adaptive": False})
    assert [o.token_ids for o in run(fixed)] == [o.token_ids for o in off]
    f = fixed.stats()
    assert f["spec_num_draft_tokens"] > s["spec_num_draft_tokens"] and "spec_num_probes" not in f


def test_adaptive_runs_are_reproducible(tiny_loaded):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "verify_row_cost": 0.2}
    a, b = make(tiny_loaded, spec), make(tiny_loaded, spec)
    run(a, prompts=PROMPTS * 2)
    run(b, prompts=PROMPTS * 2)
    keep = ("spec_num", "spec_acceptance")
    assert {k: v for k, v in a.stats().items() if k.startswith(keep)} == \
        {k: v for k, v in b.stats().items() if k.startswith(keep)}


@pytest.mark.parametrize("options, match", [
    ({"adaptive": "yes"}, "adaptive must be true or false"),
    ({"verify_row_cost": -0.1}, "verify_row_cost"),
    ({"verify_row_cost": float("nan")}, "verify_row_cost"),
    ({"bridge_jump": -0.5}, "bridge_jump must be a finite number >= 0"),
    ({"bridge_row_cost": float("inf")}, "bridge_row_cost must be a finite number >= 0"),
    ({"acceptance_smoothing": 0}, "acceptance_smoothing"),
    ({"acceptance_smoothing": 1.5}, "acceptance_smoothing"),
    ({"probe_interval": 0}, "probe_interval"),
    ({"probe_interval": 8, "max_probe_interval": 4}, "probe_interval"),
])
def test_bad_adaptive_options(options, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(speculative={"method": "ngram", **options})


def _lookup_by_scan(ids, k, min_n, max_n):
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start: start + n] == ids[len(ids) - n:]:
                return ids[start + n: start + n + k]
    return []


def test_the_incremental_ngram_index_proposes_what_a_full_scan_does():
    import random

    from kvforge.engine.speculative.ngram import NgramIndex
    rng = random.Random(0)
    for min_n, max_n in ((1, 3), (2, 4), (3, 3)):
        ids = [rng.randrange(4) for _ in range(3)]
        index = NgramIndex(min_n, max_n)
        for _ in range(120):
            assert index.propose(ids, 5) == _lookup_by_scan(ids, 5, min_n, max_n)
            ids += [rng.randrange(4) for _ in range(rng.randrange(1, 4))]


def test_spec_bench_rounds_repeat_every_group_and_report_adaptivity(tiny_loaded):
    from kvforge.bench.spec import spec_bench

    workloads = {"grounded": lambda n: PROMPTS[:n]}
    r = spec_bench(tiny_loaded, ["ngram"], batches=(2,), max_tokens=30, show=False, workloads=workloads, rounds=2,
                   spec_options={"prompt_lookup_min": 1})
    row = r["ngram"]["grounded"]["b2"]
    assert row["same_output"] and row["output_tokens"] == r["off"]["grounded"]["b2"]["output_tokens"] == 2 * 2 * 30
    assert row["cpu_speedup"] > 0 and row["num_draft_tokens"] > 0
    assert {"num_skipped_low_acceptance", "num_skipped_batch_cost", "num_skipped_batch_size", "num_probes",
            "num_trimmed_draft_tokens"} <= set(row)
    with pytest.raises(ConfigError, match="unknown methods"):
        spec_bench(tiny_loaded, ["eagle"], show=False, workloads=workloads)
    with pytest.raises(ConfigError, match="rounds"):
        spec_bench(tiny_loaded, ["ngram"], batches=(2,), show=False, workloads=workloads, rounds=0)


def test_model_drafter_probes_of_a_batch_fall_in_the_same_step():
    p = SpeculationPlanner(0.05, smoothing=0.5, probe_interval=4, max_probe_interval=16, draft_fraction=0.6)
    keys = ["a", "b", "c"]
    for k in keys:
        p.state(k).rate = 0.01
    probe_steps = {k: [] for k in keys}
    for t in range(1, 25):
        live = keys[: min(3, 1 + t // 3)]  # sequences join at different steps, so their idle counts differ
        plan = p.plan([Candidate(k, 3) for k in live], len(live))
        for k in live:
            if plan[k]:
                probe_steps[k].append(t)
                p.record(k, 1, 0)
    assert all(probe_steps.values())
    assert all(t % 4 == 0 for ts in probe_steps.values() for t in ts)
    assert probe_steps["a"][0] == probe_steps["b"][0] == 8  # joined apart (steps 1 and 3), probed together
