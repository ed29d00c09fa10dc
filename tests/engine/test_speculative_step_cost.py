"""The planner's step cost with the layer bridge's regimes: a jump past BRIDGE_ROWS, plans made on both sides of it."""
import pytest
from test_speculative import make, run

from kvforge.engine.speculative.planner import Candidate, SpeculationPlanner
from kvforge.engine.step_cost import StepCost
from kvforge.models.llama import LlamaForCausalLM
from kvforge.ops.build import load_compiled
from kvforge.ops.layer_bridge import BRIDGE_ROWS

BRIDGED = StepCost(row_cost=0.05, limit=8, jump=0.5, row_cost_above=0.05)


def planner(cost):
    return SpeculationPlanner(cost, smoothing=0.5, probe_interval=100, max_probe_interval=100)


def plan(cost, rates: dict[str, float], decoding: int, drafts: int = 5) -> dict[str, int]:
    p = planner(cost)
    for key, rate in rates.items():
        p.state(key).rate = rate
    return p.plan([Candidate(k, drafts) for k in rates], decoding)


def test_step_cost_regimes():
    assert BRIDGED(8) == pytest.approx(1.4) and BRIDGED(9) == pytest.approx(1.95)
    assert BRIDGED(48) == pytest.approx(1 + 0.5 + 0.05 * 48)
    assert not BRIDGED.linear and StepCost(0.05).linear and StepCost(0.05, 8).linear
    assert StepCost(0.05)(100) == pytest.approx(6.0)
    assert StepCost(0.1, 8, 0.5, 0.02)(9) == pytest.approx(1.68)


def test_a_full_bridged_batch_at_half_acceptance_stays_within_the_bridge():
    """8 decoding rows at rate 0.5. One line (0.05 a row): each first draft (0.5 tokens for 0.05) pays, the second
    (0.25 x 1.8 < 0.05 x 12) does not: 1 draft each. With the jump: no drafts is 8 tokens for 1.4 (5.71 a unit);
    crossing is 8.5 for 1.95, then the other first drafts, 12 for 2.3 (5.22 a unit): no drafts."""
    rates = {k: 0.5 for k in "abcdefgh"}
    assert plan(StepCost(0.05), rates, 8) == {k: 1 for k in rates}
    p = planner(BRIDGED)
    for k, r in rates.items():
        p.state(k).rate = r
    assert p.plan([Candidate(k, 5) for k in rates], 8) == {k: 0 for k in rates}
    assert p.num_skipped_batch_cost == 8 and p.num_skipped_low_acceptance == 0


def test_a_full_bridged_batch_at_high_acceptance_drafts_enough_to_pay_for_the_jump():
    """8 rows at rate 0.9: every draft depth j adds 8 x 0.9**j tokens for 8 x 0.05; all 5 drafts each is
    8 + 8 x (0.9 + 0.81 + 0.729 + 0.6561 + 0.59049) = 37.49 tokens for 1.5 + 0.05 x 48 = 3.9 (9.61 a unit > 5.71)."""
    rates = {k: 0.9 for k in "abcdefgh"}
    assert plan(BRIDGED, rates, 8) == {k: 5 for k in rates}


def test_the_tail_of_a_batch_keeps_its_drafts_within_the_bridge():
    """4 rows at rate 0.5. One line: 1 draft each (6 tokens for 1.4), a second each (7 for 1.6; 0.125 x 1.6 < 0.05 x 7
    stops the third). With the jump: within 8 rows, 6 for 1.4 (4.29 a unit); past it, the fifth row crosses (6.25 for
    1.95) and three more second drafts follow (7 for 2.1, 3.33 a unit): 1 draft each."""
    rates = {k: 0.5 for k in "abcd"}
    assert plan(StepCost(0.05), rates, 4) == {k: 2 for k in rates}
    assert plan(BRIDGED, rates, 4) == {k: 1 for k in rates}


def test_steps_that_cannot_cross_or_start_above_plan_on_one_line():
    """One sequence with 5 drafts (6 rows) never reaches the limit: the one-line plan (0.3 x 1.05 > 0.05, 0.09 x 1.1 >
    0.05 x 1.3, 0.027 x 1.15 < 0.05 x 1.39: 2 drafts). 9 decoding rows already run per-op: one line from 1.95
    (9 first drafts at 0.5, 13.5 tokens for 2.4; a second, 0.25 x 2.4 < 0.05 x 13.5, does not pay)."""
    assert plan(BRIDGED, {"a": 0.3}, 1) == plan(StepCost(0.05), {"a": 0.3}, 1) == {"a": 2}
    rates = {k: 0.5 for k in "abcdefghi"}
    assert plan(BRIDGED, rates, 9) == {k: 1 for k in rates}


def test_a_tie_between_the_regimes_keeps_the_smaller_step():
    """2 rows at rate 1.0, 7 drafts offered each, no row cost: within 8 rows, 8 tokens for 1; past it (jump 0.125),
    all 16 drafts give 16 tokens for 1.125 (not a tie), so it crosses; with jump 1.0 it is 16 for 2 = 8: a tie."""
    rates = {"a": 1.0, "b": 1.0}
    assert sum(plan(StepCost(0.0, 8, 0.125, 0.0), rates, 2, drafts=7).values()) == 14
    assert sum(plan(StepCost(0.0, 8, 1.0, 0.0), rates, 2, drafts=7).values()) == 6


def test_the_engine_plans_with_the_bridge_limit_where_the_bridge_serves(tiny_loaded, monkeypatch):
    if not load_compiled():
        pytest.skip("no compiled kvforge ops on this machine")
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "bridge_jump": 0.5}
    engine = make(tiny_loaded, spec)
    cost = engine.runner.speculator.planner.cost
    assert engine.runner.bridge_rows() == cost.limit == BRIDGE_ROWS and not cost.linear
    assert cost == engine.runner.step_cost(0.09, 0.5, 0.09)  # the runner's table, with the configured constants
    assert [o.token_ids for o in run(engine)] == [o.token_ids for o in run(make(tiny_loaded, None))]
    monkeypatch.setattr(LlamaForCausalLM, "use_bridge", False)
    per_op = make(tiny_loaded, spec)
    assert per_op.runner.bridge_rows() is None and per_op.runner.speculator.planner.cost.linear


def test_the_bench_arm_from_before_the_bridge_plans_on_one_line():
    from kvforge.bench.spec import METHODS
    from kvforge.speculative_config import SpeculativeConfig

    c = SpeculativeConfig(**METHODS["ngram_linear"])
    assert StepCost(c.verify_row_cost, BRIDGE_ROWS, c.bridge_jump, c.bridge_row_cost).linear and c.verify_row_cost == 0.055
