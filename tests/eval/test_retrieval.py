"""Retrieval suite: generated cases hold their answers; teacher-forced exact match equals greedy generation."""
from __future__ import annotations

import json
import random
from itertools import pairwise

import pytest

from kvforge.cli import main
from kvforge.eval.ppl import engine_for
from kvforge.eval.retrieval import answered, encode_case, make_cases, retrieval_scores
from kvforge.eval.retrieval_tasks import TASKS
from kvforge.sampling_params import SamplingParams


@pytest.mark.parametrize("task", list(TASKS))
def test_cases_hide_their_facts_in_order_at_the_length_asked(smol_loaded, task):
    tok = smol_loaded.tokenizer
    (_, _, case, context), = make_cases(tok, [task], [512], 1, 3, seed=1)
    text = tok.decode(context)
    where = [text.index(f) for f in case.facts]
    assert where == sorted(where) and where[0] > 0
    ids, spans = encode_case(tok, case, context)
    assert abs(len(ids) - 512) <= 8 and len(spans) == len(case.questions)
    for q, (a, b) in zip(case.questions, spans):
        assert tok.decode(ids[a:b]) == q.answer
        assert all(v in text for v in q.answer.strip().split(", "))  # every answer is in the context
    assert make_cases(tok, [task], [512], 1, 3, seed=1)[0][3] == context  # reproducible
    assert make_cases(tok, [task], [512], 1, 3, seed=2)[0][3] != context


def test_teacher_forced_exact_match_equals_greedy_generation(smol_loaded):
    """Each answer counts as right exactly when greedy decoding from the tokens before it writes it."""
    tok = smol_loaded.tokenizer
    cases = make_cases(tok, ["niah_multikey", "multivalue"], [320], 1, 3, seed=0)
    engine = engine_for(smol_loaded, 384)
    seen = []
    for _, _, case, context in cases:
        ids, spans = encode_case(tok, case, context)
        got = answered(engine, len(context), ids, spans, chunk_size=64)
        for (a, b), right in zip(spans, got):
            engine.add_request(ids[:a], SamplingParams(temperature=0, max_tokens=b - a, ignore_eos=True))
            out = None
            while engine.has_unfinished_requests():
                out = [o for o in engine.step() if o.finished] or out
            assert (out[0].token_ids == ids[a:b]) == right
            seen.append(right)
    assert engine.kv.allocator.num_used == 0
    assert True in seen and False in seen  # both outcomes were checked


def test_compressed_context_serves_every_question_and_frees_its_blocks(smol_loaded):
    tok = smol_loaded.tokenizer
    cases = make_cases(tok, ["niah_multikey"], [512], 1, 3, seed=0)
    engine = engine_for(smol_loaded, 600, kv_policy="snapkv", kv_policy_options={"budget": 0.5})
    held: list[int] = []
    scores = retrieval_scores(engine, tok, cases, chunk_size=64, held=held)
    assert set(scores) == {"niah_multikey"} and 0 <= scores["niah_multikey"]["512"] <= 1
    stats = engine.stats()
    context = len(cases[0][3])  # snapkv halves the context once, before any question; answers are all kept
    assert stats["kv_evicted_tokens"] == context - context // 2 and stats["kv_blocks_used"] == 0
    assert held == [-(-(context // 2) // engine.kv.block_size)]  # the questions began on the halved context's blocks


def test_cli_refuses_unknown_tasks_and_lengths_past_the_context(capsys):
    assert main(["eval", "retrieval", "--tasks", "niah_single,needle"]) == 2
    assert "unknown needle; allowed: niah_single" in capsys.readouterr().err
    assert main(["eval", "retrieval", "--lengths", "1024,9000"]) == 2
    assert "9000 tokens exceed the model's context of 8192" in capsys.readouterr().err


def test_variable_tracking_chains_assign_in_order():
    case = TASKS["variable_tracking"](random.Random(0), 4)
    first = {f.split(" = ")[0][4:]: f.split(" = ")[1].rstrip(".") for f in case.facts}
    for q in case.questions:
        names = q.answer.strip().split(", ")
        assert first[names[0]].isdigit() and all(first[b] == a for a, b in pairwise(names))


def test_cli_scores_every_variant_on_the_same_cases_beside_the_full_cache(capsys):
    rc = main(["eval", "retrieval", "--tasks", "niah_single", "--lengths", "256", "--contexts", "2", "--no-progress",
               "--variant", "fp32+keydiff:0.5", "--kv-policy", "snapkv", "--budget", "0.5", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert list(r["variants"]) == ["fp32+keydiff:0.5", "fp32 snapkv 0.5"]
    full = r["full"]["accuracy"]["niah_single"]["256"]
    for v in r["variants"].values():
        acc = v["accuracy"]["niah_single"]["256"]
        assert acc in (0.0, 0.5, 1.0) and v["relative"]["niah_single"]["256"] == (acc / full if full else None)
        assert v["peak_kv_bytes"] < r["full"]["peak_kv_bytes"]  # the compressed caches held fewer blocks
        assert 0 < v["context_kv_bytes"] < r["full"]["context_kv_bytes"]
