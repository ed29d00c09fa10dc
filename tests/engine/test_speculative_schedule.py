"""Drafts travel with the step's schedule: the scheduler keeps those that fit, a model drafter fills them in the batch,
and no request changes until the step commits."""
import copy

import pytest
from test_speculative import NGRAM, PROMPTS, make, run

from kvforge.sampling_params import SamplingParams

SKIP = {"method": "layer_skip", "num_speculative_tokens": 4, "num_layers": 1}


def request_state(seqs) -> list[dict]:
    return [copy.deepcopy({k: v for k, v in vars(seq).items() if k != "generator"}) for seq in seqs]


@pytest.mark.parametrize("spec", [NGRAM, SKIP], ids=["ngram", "layer_skip"])
def test_running_a_step_changes_no_request_state(tiny_loaded, monkeypatch, spec):
    """The runner (model drafter included) reads the batch's sequences and writes only the batch and its result."""
    engine, changed = make(tiny_loaded, spec), []
    execute = engine.runner.execute

    def checked(batch):
        before = request_state(batch.seqs)
        result = execute(batch)
        changed.append(request_state(batch.seqs) != before)
        return result

    monkeypatch.setattr(engine.runner, "execute", checked)
    on = run(engine)
    assert changed and not any(changed) and engine.stats()["spec_num_draft_tokens"] > 0
    assert [o.token_ids for o in on] == [o.token_ids for o in run(make(tiny_loaded, None))]


def test_drafts_that_do_not_fit_the_token_budget_stay_out_of_the_batch(tiny_loaded):
    engine = make(tiny_loaded, NGRAM, max_num_batched_tokens=6)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a, b = (engine.add_request(p, params) for p in PROMPTS[:2])
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    proposed = {a: [1, 2, 3], b: [4, 5, 6]}
    batch = engine.scheduler.schedule(proposed)
    assert [s.request_id for s in batch.seqs] == [a, b] and batch.num_new_tokens == [4, 2]
    assert batch.draft_token_ids == {a: [1, 2, 3], b: [4]} and proposed == {a: [1, 2, 3], b: [4, 5, 6]}
    assert batch.drafting().num_new_tokens == [4, 2]
