"""`kvforge bench tiers` on a tiny model: every JSON key the issue names, each tier serves second asks, swap gives
the outputs recompute gives and recomputes nothing, the second engine reuses what the first put in Redis."""
from __future__ import annotations

from kvforge.bench.tiers import tiers_bench


def test_bench_tiers_reports_every_key(tiny_loaded, redis_url):
    r = tiers_bench(tiny_loaded, docs=10, doc_tokens=96, kv_dtype="int8", pool_docs=2, host_docs=2, disk_docs=3,
                    redis_url=redis_url, pressure_requests=4, replica_docs=3, show=False)
    assert r["second_pass_hit_rate"] > 0.5
    assert set(r["ttft_ratio"]) == {"pool", "host", "disk", "redis"}
    assert r["asks_by_source"]["recompute"] >= 10  # every first ask
    assert sum(r["asks_by_source"].get(t, 0) for t in ("host", "disk", "redis")) > 0
    assert set(r["bytes_per_token"]) <= {"host", "disk", "redis"} and r["bytes_per_token"]
    assert r["pressure"]["same_outputs"] and r["pressure"]["swap"]["tokens_recomputed"] == 0
    assert r["pressure"]["recompute"]["tokens_recomputed"] > 0 and r["swap_vs_recompute_throughput"] > 0
    assert r["cross_replica_hit_rate"] == 1.0 and r["cross_replica_ttft_ratio"] > 0


def test_host_write_modes_compares_both_arms(tiny_loaded):
    """The reason the host tier writes back by default: a write-through copy of what the pool holds takes its room."""
    from kvforge.bench.tier_write_modes import host_write_modes

    r = host_write_modes(tiny_loaded, docs=6, doc_tokens=64, kv_dtype="int8", pool_docs=2, host_docs=2, seed=0,
                         show=False)
    back, through = r["write-back"], r["write-through"]
    assert back["second_ask_hit_rate"] > through["second_ask_hit_rate"]
    assert back["stored_blocks"] > 0 and through["stored_blocks"] > 0 and r["write_through_vs_back_time"] > 0
