"""The tier fault run, small (tier_fault_suite.py): two `kvforge serve` processes, of two models that differ only in
rope_theta, share one Redis and one disk directory through an engine restart, a paused, killed and restarted
Redis, stray and corrupt files, and good, bad and abandoned requests. What must be zero is zero, and the
directory stays within its budget."""
from tier_fault_suite import SMALL, run_tier_fault_suite

MUST_BE_ZERO = ("wrong_tokens", "good_requests_failed", "hung", "bad_inputs_not_400", "engine_crashes", "leaked_blocks",
                "leaked_request_states", "tree_nodes_after_reset")


def test_engines_sharing_tiers_survive_faults(tmp_path):
    report = run_tier_fault_suite(SMALL, seed=0, workdir=str(tmp_path))
    counts = report.counts()
    assert report.completed > 0 and report.compared_greedy == report.completed and report.engine_restarts == 1
    assert {k: counts[k] for k in MUST_BE_ZERO} == dict.fromkeys(MUST_BE_ZERO, 0), report.failures
    assert report.disk_bytes_max <= report.disk_budget_bytes
