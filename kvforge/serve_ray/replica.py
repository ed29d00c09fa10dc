"""One replica: an LLMEngine and the same FastAPI app as `kvforge serve`, reached through Ray Serve's handle.

The ingress forwards each HTTP request to `handle`; authorization, per-key cache salts, validation, streaming
and errors are the app's own, so every replica behaves as a single `kvforge serve` does. The replica reports
its KV usage, load, prefix hit rate, Prometheus text and the prompt chunks of the requests its app accepted
(record_routing_stats; a 400 or 401 records nothing), and
fails Ray's health check once its engine loop has died, so Ray replaces it.
"""
from __future__ import annotations

import os
from collections.abc import AsyncIterator

from kvforge.serve_ray.asgi import Head, call_asgi
from kvforge.serve_ray.prefix_keys import CHUNK_TOKENS, ChunkSet, RoutingKey, chunk_hashes
from kvforge.server import ServerConfig, build_app

REPORTED_CHUNKS = 4096  # newest chunk hashes sent to the router in each stats report
REPLICA_HEADER = "x-kvforge-replica"


class KVForgeReplica:
    def __init__(self, engine_kwargs: dict, server_config: ServerConfig, torch_threads: int | None = None):
        import torch

        from kvforge.config import EngineConfig
        from kvforge.engine.engine import LLMEngine

        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.engine = LLMEngine(EngineConfig(**engine_kwargs))
        self.app = build_app(self.engine, server_config)
        self.loop = self.app.state.engine_loop
        self.loop.start()
        self.replica_id = _replica_id()
        capacity_tokens = self.engine.stats()["kv_blocks_total"] * self.engine.kv.block_size
        self.served = ChunkSet(max(1, capacity_tokens // CHUNK_TOKENS))

    async def handle(self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes,
                     key: RoutingKey | None) -> AsyncIterator[Head | bytes]:
        async for item in call_asgi(self.app, method, path, query, headers, body):
            if isinstance(item, tuple):
                status, head = item
                if key and status < 400:  # the app accepted it: its prompt is (being) cached here
                    self.served.add(chunk_hashes(key))
                item = status, [*head, (REPLICA_HEADER, self.replica_id)]
            yield item

    def check_health(self) -> None:
        if not self.loop.alive:
            raise RuntimeError(f"kvforge replica {self.replica_id}: the engine loop is not running ({self.loop.error})")

    async def record_routing_stats(self) -> dict:
        stats = {**await self.loop.call(lambda e: e.stats()), "outputs_held": self.loop.held_outputs()[0]}
        queried = stats.get("prefix_queried_tokens", 0)
        return {
            "kv_usage": float(stats.get("kv_usage", 0.0)),
            "load": int(stats.get("running", 0)) + int(stats.get("waiting", 0)),
            "prefix_hit_rate": stats.get("prefix_hit_tokens", 0) / queried if queried else 0.0,
            "prefix_chunks": self.served.newest(REPORTED_CHUNKS),
            "prefix_chunks_held": len(self.served),
            "metrics": self.loop.metrics.render(stats),
        }

    def __del__(self) -> None:
        """Ray Serve's replica shutdown: stop the loop, then close the engine (its KV cache stays in the tiers)."""
        loop = getattr(self, "loop", None)
        if loop is not None and loop.stop(timeout=5):
            self.engine.close()


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a Serve replica (direct use in tests)
        return f"pid-{os.getpid()}"
