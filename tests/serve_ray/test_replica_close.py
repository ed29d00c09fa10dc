"""A replica that Ray Serve shuts down (its `__del__`) closes its engine, so a write-back disk tier keeps the cache."""
from __future__ import annotations

import asyncio
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "server"))
from faults import write_tiny_char_model

from kvforge.serve_ray.replica import KVForgeReplica
from kvforge.server import ServerConfig

PROMPT = "the quick brown fox jumps over the lazy dog"  # 43 characters: 2 whole blocks of 16 tokens


async def _complete(replica: KVForgeReplica) -> int:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2, "temperature": 0}).encode()
    items = [i async for i in replica.handle("POST", "/v1/completions", "", [("content-type", "application/json")],
                                             body, None)]
    return items[0][0]


def test_replica_shutdown_closes_its_engine(tmp_path):
    write_tiny_char_model(tmp_path / "model")
    tier = tmp_path / "tier"
    kwargs = {"model": str(tmp_path / "model"), "kv_cache_memory": 8 << 20, "max_model_len": 512,
              "kv_tiers": [f"disk:{tier}:16MiB"], "kv_tier_write_through": False}
    replica = KVForgeReplica(kwargs, ServerConfig())
    assert asyncio.run(_complete(replica)) == 200
    assert not [f for f in os.listdir(tier) if f.endswith('.kvb')]
    engine = replica.engine
    replica.__del__()
    assert engine.tiers.closed and len([f for f in os.listdir(tier) if f.endswith('.kvb')]) == 2
