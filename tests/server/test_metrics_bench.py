"""/metrics exposes the engine's KV and request counters; `kvforge bench serve` reports latency and throughput."""
import json

import httpx

from kvforge.cli import main

NAMES = ["kvforge_kv_blocks_used", "kvforge_kv_blocks_total", "kvforge_kv_usage_ratio",
         "kvforge_prefix_cache_queries_total", "kvforge_prefix_cache_hits_total", "kvforge_preemptions_total",
         "kvforge_requests_running", "kvforge_requests_waiting", "kvforge_generation_tokens_total",
         "kvforge_stream_outputs_held",
         "kvforge_time_to_first_token_seconds_bucket", "kvforge_inter_token_latency_seconds_bucket"]


def test_metrics_text(server, client, model_name):
    client.completions.create(model=model_name, prompt="Hello there", max_tokens=3, temperature=0)
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in NAMES:
        assert f"\n{name}" in r.text, name
    lines = dict(line.rsplit(" ", 1) for line in r.text.splitlines() if not line.startswith("#"))
    assert float(lines["kvforge_kv_blocks_total"]) == server.engine.kv.num_blocks
    assert float(lines['kvforge_time_to_first_token_seconds_bucket{le="+Inf"}']) >= 1
    assert float(lines["kvforge_inter_token_latency_seconds_count"]) >= 2


def test_bench_serve_cli(server, capsys):
    rc = main(["bench", "serve", "--url", server.url, "--num-requests", "6", "--prompt-len", "8", "24",
               "--output-len", "4", "6", "--max-concurrency", "3", "--json", "--no-progress"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["ttft_ms"]["p50"] > 0 and result["tpot_ms"]["p50"] > 0 and result["output_tok_s"] > 0
    assert 6 * 4 <= result["output_tokens"] <= 6 * 6, "ignore_eos makes every request generate its max_tokens"
    assert set(result["ttft_ms"]) == {"p50", "p90", "p99", "mean"}
