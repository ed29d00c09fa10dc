"""Closing an engine's tiers so a restart keeps its KV cache.

Write-through tiers already got every cached block; write-back tiers get a block only when it leaves the pool (or
the host tier above), so at close the prefix tree's blocks (and checkpoints, compressed prompts) and what host tiers hold are written to the shared
write-back tiers (disk, Redis) that lack them, prefix tops first. Then the queued stores drain. All of it within a
deadline: what did not make it is counted (`tier_close_unwritten_blocks`) and logged; nothing blocks shutdown.
"""
from __future__ import annotations

import logging
import time
from functools import partial

from kvforge.kv.tiers.compressed_tiers import encode
from kvforge.kv.tiers.keys import BlockKey

CLOSE_TIMEOUT_S = 10.0
log = logging.getLogger("kvforge.kv.tiers")


def close_tiers(connector, prefix_tree, timeout: float = CLOSE_TIMEOUT_S) -> dict:
    """Persist the prefix tree's blocks through a TierConnector, drain its store queue and close its chain, in at most
    ~`timeout` seconds; returns what it wrote and left."""
    start = time.monotonic()
    deadline = start + timeout
    queued, skipped = persist_cached(connector, prefix_tree, deadline)
    unwritten = connector.tiers.close(max(0.0, deadline - time.monotonic())) + skipped
    written = {"tier_close_queued_blocks": queued, "tier_close_unwritten_blocks": unwritten}
    seconds = time.monotonic() - start
    if unwritten:
        log.warning("KV tiers: %d blocks were not written within %.1f s at close; the next process recomputes them",
                    unwritten, timeout)
    elif queued:
        log.info("KV tiers: %d cached blocks written at close in %.2f s", queued, seconds)
    return written


def persist_cached(connector, tree, deadline: float) -> tuple[int, int]:
    """Queue the prefix tree's blocks, the state checkpoints and compressed prompts in memory, then host tiers'
    entries, for the shared write-back tiers that lack them.
    Returns (blocks queued, blocks left out at the deadline)."""
    chain = connector.tiers
    targets = [t for t in chain.back_tiers if chain.tiers[t].shared]
    if not targets:
        return 0, 0
    queued = skipped = 0
    for node in tree.nodes() if tree is not None else []:
        if time.monotonic() >= deadline:
            skipped += len(node.block_ids)
            continue
        salt, tokens = tree.path(node)
        keys = connector.keys.chain(tokens, salt)[-len(node.block_ids):]
        lacking = _lacking(chain, keys, targets)
        ids = [b for b, lack in zip(node.block_ids, lacking) if lack]
        items = list(zip([k for k, lack in zip(keys, lacking) if lack], connector.block_io.export_blocks(ids)))
        if chain.store_to(items, targets, push=False):
            queued += len(items)
        else:
            skipped += len(items)
    for key, payload in _held_entries(connector):  # state checkpoints and compressed prompts in memory
        if time.monotonic() >= deadline:
            skipped += 1
        elif _lacking(chain, [key], targets)[0]:
            if chain.store_to([(key, payload())], targets, push=False):
                queued += 1
            else:
                skipped += 1
    for t, tier in enumerate(chain.tiers):
        if tier.shared or not hasattr(tier, "items"):
            continue
        entries = tier.items()
        if time.monotonic() >= deadline:
            skipped += len(entries)
            continue
        lacking = _lacking(chain, [k for k, _ in entries], targets)
        items = [e for e, lack in zip(entries, lacking) if lack]
        if chain.store_to(items, targets, push=False):
            queued += len(items)
        else:
            skipped += len(items)
    return queued, skipped


def _held_entries(connector):
    """(key, payload()) of each entry the manager holds in memory beside its blocks: a recurrent model's state
    checkpoints, kvzip's compressed prompts."""
    held = getattr(connector, "held_checkpoints", None)
    for tokens, salt, payload in held() if held is not None else []:
        yield connector.states.key(tokens, salt), payload
    held = getattr(connector, "held_compressed", None)
    for policy, salt, tokens, rows, state, ids in held() if held is not None else []:
        yield connector.compressed.key(policy, salt, tokens), partial(_compressed_payload, connector, rows,
                                                                       len(tokens), state, ids)


def _compressed_payload(connector, rows: int, num_tokens: int, state, block_ids: list[int]) -> bytes:
    return encode(rows, num_tokens, state, connector.block_io.export_blocks(block_ids))


def _lacking(chain, keys: list[BlockKey], targets: list[int]) -> list[bool]:
    """For each key: does some target tier not hold it (a tier that cannot answer holds nothing)?"""
    lacking = [False] * len(keys)
    for t in targets:
        held = chain.call(t, chain.tiers[t].contains, keys, default=[False] * len(keys), load=True)
        lacking = [lack or not h for lack, h in zip(lacking, held)]
    return lacking
