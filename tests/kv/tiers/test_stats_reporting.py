"""Tier statistics reach engine.stats(), generate --json and /metrics; `kvforge memory` sizes tiers in tokens."""
from __future__ import annotations

from tier_helpers import ask_flushed, docs, engine

from kvforge.cli.generate import kv_stats
from kvforge.cli.memory import tier_capacity
from kvforge.server.metrics import ServerMetrics


def test_stats_json_and_metrics_carry_tier_counters(tiny_loaded, tmp_path):
    e = engine(tiny_loaded, tiers=["host:8KiB", f"disk:{tmp_path}:1MiB"])
    outs = ask_flushed(e, docs() + docs())
    s = e.stats()
    assert s["kv_tiers"] == ["host", "disk"] and s["tier_hit_tokens"] == 4 * 32
    assert s["tier_host_hit_tokens"] + s["tier_disk_hit_tokens"] == 4 * 32
    assert s["tier_disk_used_bytes"] > 0 and s["tier_host_used_bytes"] <= 8 * 1024
    assert s["tier_disk_load_p99_ms"] >= s["tier_disk_load_p50_ms"] > 0
    report = kv_stats(e, [1, 2, 3], outs[-1:])
    assert report["tier_hit_tokens"] == 4 * 32 and report["kv_tiers"] == ["host", "disk"]
    text = ServerMetrics().render(s)
    assert f'kvforge_kv_tier_hit_tokens{{tier="disk"}} {float(s["tier_disk_hit_tokens"])}' in text
    assert f"kvforge_kv_tier_prefix_hits_total {float(4 * 32)}" in text


def test_memory_sizes_tiers_in_tokens_of_the_format():
    int8, fp32 = tier_capacity(["host:1GiB", "redis://127.0.0.1:6379"], 100.0), tier_capacity(["host:1GiB"], 400.0)
    assert int8[0]["tokens"] == 2**30 // 100 and int8[1]["tokens"] is None
    assert fp32[0]["tokens"] == 2**30 // 400
