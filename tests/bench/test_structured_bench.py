"""bench structured: both arms give the same tokens, and jump-forward needs fewer steps for them."""
from kvforge.bench.structured import structured_bench
from kvforge.cli import build_parser


def test_structured_bench_compares_the_same_outputs(smol_loaded):
    r = structured_bench(smol_loaded, num_requests=4, max_tokens=40, rounds=1, kv_cache_memory=64 << 20)
    assert r["identical"] and r["output_tokens"] > 40
    assert r["jump_forward_tokens_per_round"] > 0 and r["jump"]["steps"] < r["stepwise"]["steps"]
    assert r["speedup"] == r["jump"]["output_tok_s"] / r["stepwise"]["output_tok_s"]


def test_bench_structured_is_a_subcommand():
    args = build_parser().parse_args(["bench", "structured", "--num-requests", "2", "--json"])
    assert args.num_requests == 2 and args.json and args.func.__name__ == "run_structured"
