"""Faults injected into the model forward, the sampler and the tokenizer while 64 clients stream, disconnect,
send bad inputs and one never reads: nothing hangs, only faulted requests fail, the rest is exact, nothing leaks."""
import json

import pytest
from fault_suite import BAD, SLOW_MAX_TOKENS, SLOW_N, run_fault_suite


@pytest.fixture(scope="module")
def report(char_dir):
    r = run_fault_suite(char_dir, seed=0)
    print(r.counts())
    return r


def test_every_request_ends_and_faults_were_injected(report):
    counts = report.counts()
    assert counts["hung"] == 0
    assert set(report.injector.injected) >= {"forward", "sample"} and counts["errors_returned"] > 0
    assert counts["completed"] > 0 and counts["bad_inputs_400"] > 0


def test_only_requests_hit_by_a_fault_get_errors(report):
    failed_steps = {ids for batch in report.injector.failed_batches for ids in batch}
    for r in report.results:
        if r.outcome == "error":
            assert r.status in (200, 500) and "injected" in r.message, (r.job, r.status, r.message)  # 200: in-stream
            if "forward fault" in r.message or "sample fault" in r.message:
                assert report.prompt_ids[r.job.prompt] in failed_steps
    hit = {r.job.prompt for r in report.results if r.outcome in ("error", "quit")}
    for batch in report.injector.failed_batches:  # everyone in a failing step was told (or had left)
        for ids in batch:
            prompts = [p for p, i in report.prompt_ids.items() if i == ids]
            assert not prompts or prompts[0] in hit, prompts


def test_bad_inputs_get_a_400_naming_the_parameter(report):
    bad = [r for r in report.results if r.job.kind == "bad"]
    assert sorted(r.job.bad for r in bad) == sorted(BAD)
    for r in bad:
        if r.outcome == "error" and "injected encode fault" in r.message:
            continue  # the tokenizer failed on its (valid) text prompt before the engine could refuse it
        param = BAD[r.job.bad][1]
        assert r.outcome == "bad" and json.loads(r.message)["error"]["param"] == param, (r.job.bad, r.message)


def test_completed_outputs_equal_offline_greedy(report):
    ok = [r for r in report.results + report.after if r.outcome == "ok"]
    assert len(report.after) == 8 and all(r.outcome == "ok" for r in report.after)
    for r in ok:
        assert (r.texts[0], r.reasons[0]) == report.expected[(r.job.prompt, r.job.max_tokens)], r.job


def test_slow_reader_memory_is_bounded_and_nothing_leaks(report):
    outputs, tokens = report.slow_reader_held
    assert 0 < outputs <= SLOW_N and tokens <= SLOW_N * SLOW_MAX_TOKENS  # behind, yet one output per choice
    assert report.slow_reader_held_in_faults[0] <= SLOW_N
    assert report.released_after_close == [True, True]  # and let go when the reader hangs up
    assert report.blocks_used_after_reset == 0
