"""Request routers for the replica deployment (Ray Serve's RequestRouter API, run by the ingress's handle).

PrefixAffinityRouter sends a request to the replica holding the longest prefix of its prompt: what the replica
reports it holds (record_routing_stats, every few seconds) joined with what this router sent it since (at once).
It falls back to the least-loaded replica when no replica holds enough of the prompt or when the best one has
`imbalance` more requests in flight than the least-loaded one. Pow2Router is Ray's power-of-two-choices.
Both record their choices and themselves in registry.py, read by the ingress's /metrics.
"""
from __future__ import annotations

import random
from collections import Counter

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvforge.serve_ray.prefix_keys import ChunkSet, chunk_hashes, matched_chunks


class _Reporting:
    """Registers the router so the ingress can read every replica's reported stats."""

    def replica_stats(self) -> dict[str, dict]:
        return {rid.unique_id: r.routing_stats or {} for rid, r in self.curr_replicas.items()}


class Pow2Router(_Reporting, PowerOfTwoChoicesRequestRouter):
    def initialize_state(self, **kwargs) -> None:
        _registry().register(self)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        _registry().count("pow2", "pow2")


class PrefixAffinityRouter(_Reporting, RequestRouter):
    def initialize_state(self, match_threshold: float = 0.5, imbalance: int = 16, chunks_per_replica: int = 65536,
                         **kwargs) -> None:
        self.match_threshold = match_threshold
        self.imbalance = imbalance
        self.chunks_per_replica = chunks_per_replica
        self._sent: dict[ReplicaID, ChunkSet] = {}
        self._in_flight: Counter = Counter()
        self._claims: dict[str, tuple[ReplicaID, str]] = {}  # request id -> (first-ranked replica, why) until routed
        self._reported_sets: dict[ReplicaID, tuple[list, set]] = {}
        _registry().register(self)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:  # a retry: its earlier claim no longer holds
            self._release(pending_request.metadata.internal_request_id)
        key = _key_of(pending_request)
        hashes = chunk_hashes(key) if key else []
        by_load = sorted(candidate_replicas, key=self._balance_order)
        least = by_load[0]
        decision = "least_loaded"
        if hashes:
            matched = {r.replica_id: self._matched(r, hashes) for r in candidate_replicas}
            best = max(candidate_replicas, key=lambda r: (matched[r.replica_id], -self._in_flight[r.replica_id]))
            if matched[best.replica_id] / len(hashes) >= self.match_threshold:
                if self._in_flight[best.replica_id] - self._in_flight[least.replica_id] <= self.imbalance:
                    by_load.remove(best)
                    by_load.insert(0, best)
                    decision = "prefix_match"
                else:
                    decision = "imbalance_fallback"
        if pending_request is not None:
            self._claim(pending_request.metadata.internal_request_id, by_load[0].replica_id, hashes, decision)
        return [[r] for r in by_load]

    def _claim(self, request_id: str, replica_id: ReplicaID, hashes: list[str], decision: str) -> None:
        """Count the request on its first-ranked replica now, so requests routed before it lands see it."""
        self._claims[request_id] = replica_id, decision
        self._in_flight[replica_id] += 1
        if hashes:
            self._sent.setdefault(replica_id, ChunkSet(self.chunks_per_replica)).add(hashes)

    def _release(self, request_id: str) -> str:
        replica_id, decision = self._claims.pop(request_id, (None, "least_loaded"))
        if replica_id is not None and self._in_flight[replica_id] > 0:
            self._in_flight[replica_id] -= 1
        return decision

    def _balance_order(self, r: RunningReplica) -> tuple:
        stats = r.routing_stats or {}
        owned = len(self._sent.get(r.replica_id, ())) + int(stats.get("prefix_chunks_held", 0))
        return self._in_flight[r.replica_id], stats.get("kv_usage", 0.0), owned, random.random()

    def _matched(self, r: RunningReplica, hashes: list[str]) -> int:
        return matched_chunks(hashes, self._sent.get(r.replica_id, ()), self._reported(r))

    def _reported(self, r: RunningReplica) -> set[str]:
        chunks = (r.routing_stats or {}).get("prefix_chunks", [])
        cached = self._reported_sets.get(r.replica_id)
        if cached is None or cached[0] is not chunks:
            cached = self._reported_sets[r.replica_id] = (chunks, set(chunks))
        return cached[1]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        decision = self._release(pending_request.metadata.internal_request_id)
        self._in_flight[replica_id] += 1
        _registry().count("prefix", decision)
        key = _key_of(pending_request)
        if key:
            self._sent.setdefault(replica_id, ChunkSet(self.chunks_per_replica)).add(chunk_hashes(key))

    def forget(self, replica: str, hashes: list[str]) -> None:
        """The request sent these chunks to `replica` (unique id) and its app refused it: they are not held there."""
        for replica_id, sent in self._sent.items():
            if getattr(replica_id, "unique_id", replica_id) == replica:
                sent.discard(hashes)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._in_flight[replica_id] > 0:
            self._in_flight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._sent.pop(replica_id, None)
        self._in_flight.pop(replica_id, None)
        self._reported_sets.pop(replica_id, None)


def _key_of(pending_request: PendingRequest | None):
    """The routing key the ingress passes as the last positional argument of Replica.handle."""
    if pending_request is None or not pending_request.args:
        return None
    key = pending_request.args[-1]
    return key if isinstance(key, (str, list)) else None


def _registry():
    from kvforge.serve_ray import registry  # the process's one copy, not this (pickled) module's globals

    return registry
