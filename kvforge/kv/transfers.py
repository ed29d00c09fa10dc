"""ConnectorTransfers: the KVCacheManager's side of what its KV connector moves (kvforge.kv.connector).

The connector moves bytes; this keeps the blocks: a request's transfer in flight lives in its RequestKV (`load`),
the scheduler keeps the request in `loading` while it is there, and when it has arrived blocks are given (a prefix
load takes pool blocks then, reclaiming idle ones; a swap-in reserved its blocks when it started), the connector
imports into them, and a prefix load's blocks enter the prefix tree, where the request re-matches them. A request
never runs on half-loaded K/V: blocks after the first unreadable one are recomputed, and a swap-in that lost a block
starts over by recompute. A recurrent model's state slot goes out with the blocks (Resume.state) and comes back
into a slot taken at swap-in; its prefix load brings the deepest state checkpoint with the KV blocks up to it, which
enter the prefix tree and the checkpoint store, and the request re-matches from there. A compressed prompt (kvzip with
reuse) comes into new blocks, is kept in memory for later requests, and the request adopts it.
"""
from __future__ import annotations

from kvforge.kv.connector import Resume, Transfer
from kvforge.kv.memory import blocks_for_tokens
from kvforge.kv.request_kv import RequestKV
from kvforge.kv.state_checkpoints import checkpoint_key


class ConnectorTransfers:
    def __init__(self, kv):
        self.kv = kv  # the KVCacheManager whose blocks, tables and prefix tree these transfers fill

    def start_load(self, req, usable: int, matched: int) -> None:
        """After the prefix tree matched `matched` tokens, fetch what the connector holds of the first `usable`."""
        load = self.kv.connector.start_load(req.token_ids[:usable], req.cache_salt, matched)
        if load is not None:
            self.kv._state(req).load = load

    def start_state_load(self, req, usable: int, matched: int, count: bool) -> None:
        """A recurrent model's start_load: after the pool's KV and checkpoint (`matched` tokens), the deepest state
        checkpoint the tiers hold with the KV blocks up to it. `count`: a first match, whose shortfall against the
        KV held (pool and tiers) is counted once the depths are known."""
        kv = self.kv
        tokens = req.token_ids[:usable]
        cached = min(tree.peek_prefix(tokens, req.cache_salt) for tree in kv.prefix_trees)
        load, kv_depth = kv.connector.start_state_load(tokens, req.cache_salt, matched, cached)
        if load is None:
            if count:
                kv._count_short(matched, kv_depth)
            return
        load.state_load = (cached, count)
        kv._state(req).load = load

    def attach_compressed(self) -> None:
        """Compressed prompts that give way in memory go to the connector (write-back), and close finds those held."""
        kv = self.kv
        kv.compressed.on_reclaim = lambda salt, tokens, entry: kv.connector.on_compressed(
            kv.compressed.namespace, tokens, salt, entry.rows, entry.policy_state, entry.block_tables[0],
            compressed=False)
        kv.connector.held_compressed = self.held_compressed

    def held_compressed(self) -> list[tuple]:
        """The compressed prompts in memory as (policy namespace, salt, tokens, rows, policy state, block ids)."""
        c = self.kv.compressed
        return [(c.namespace, salt, list(tokens), e.rows, e.policy_state, e.block_tables[0])
                for (_, salt, tokens), e in c.entries.items()]

    def start_compressed_load(self, req) -> None:
        """No compressed prompt in memory starts req: fetch the longest the connector holds."""
        kv = self.kv
        load = kv.connector.start_compressed_load(kv.compressed.namespace, req.token_ids, req.cache_salt)
        if load is not None:
            kv._state(req).load = load

    def is_loading(self, req) -> bool:
        state = self.kv.requests.get(req.request_id)
        return state is not None and state.load is not None

    def wait_for_load(self, req, timeout: float) -> None:
        state = self.kv.requests.get(req.request_id)
        if state is not None and state.load is not None:
            self.kv.connector.wait(state.load, timeout)

    def finish_load(self, req) -> bool:
        """Import req's fetched blocks once they are in; False while fetching."""
        state = self.kv.requests[req.request_id]
        load = state.load
        if not self.kv.connector.done(load):
            return False
        state.load = None
        payloads = load.future.result()
        if load.state_load is not None:
            self._finish_state_load(req, load, payloads)
        elif load.compressed:
            self._finish_compressed_load(req, payloads)
        elif load.resume is not None:
            self._finish_swap_in(state, load, payloads)
        else:
            self._finish_prefix_load(req, state, load, payloads)
        return True

    def _finish_prefix_load(self, req, state: RequestKV, load: Transfer, payloads: list) -> None:
        kv = self.kv
        good = next((i for i, p in enumerate(payloads) if p is None), len(payloads))
        if good and not kv.allocator.can_allocate(good):
            kv._reclaim(good - kv.allocator.num_free)
        good = min(good, kv.allocator.num_free)
        if not good:
            return
        ids = kv.allocator.allocate(good)
        kv.peak_blocks_used = max(kv.peak_blocks_used, kv.allocator.num_used)
        kv.connector.finish_load(ids, payloads[:good])
        state.block_table.extend(ids)
        state.num_matched = state.num_adopted = load.matched + good * kv.block_size
        tree = kv.prefix_tree
        _, node = tree.insert(req.token_ids[:state.num_matched], state.block_table, salt=req.cache_salt)
        tree.lock(node)
        if state.prefix_node is not None:
            tree.unlock(state.prefix_node)
        state.prefix_nodes[:1] = [node]  # a connector serves one KV group (kvforge.kv.tiers.setup checks it)

    def _finish_state_load(self, req, load: Transfer, fetch) -> None:
        cached, count = load.state_load
        resumed = load.matched
        if fetch.resume and all(p is not None for p in fetch.payloads) and self._keep_state_fetch(req, cached, fetch):
            resumed = fetch.resume
        if count:
            self.kv._count_short(resumed, fetch.kv_depth)

    def _keep_state_fetch(self, req, cached: int, fetch) -> bool:
        """The fetched KV blocks (after the pool's `cached` tokens) into the prefix tree, the checkpoint into the
        store; False when the pool lost its part of the prefix meanwhile, has no room, or the payload is not this
        pool's."""
        kv, salt = self.kv, req.cache_salt
        blocks, tokens = fetch.payloads[:-1], req.token_ids[:fetch.resume]
        try:
            checkpoint = kv.state_pool.checkpoint_from_payload(fetch.payloads[-1])
        except ValueError:
            return False
        if blocks:
            tree = kv.prefix_tree
            held = tree.match_prefix(tokens[:cached], salt=salt)
            if held.num_tokens < cached:
                return False
            tree.lock(held.node)  # its blocks must outlive the reclaim that makes room for the new ones
            try:
                if not kv.make_room(len(blocks)):
                    return False
                ids = kv.allocator.allocate(len(blocks))
                kv.peak_blocks_used = max(kv.peak_blocks_used, kv.allocator.num_used)
                kv.connector.finish_load(ids, blocks)
                tree.insert(tokens, held.block_ids + ids, salt=salt)
                kv.allocator.decref(ids)  # the tree holds them (or kept its own, and these go back)
            finally:
                tree.unlock(held.node)
        kv.checkpoints.put(checkpoint_key(salt, tokens), checkpoint, from_tier=True)
        return True

    def _finish_compressed_load(self, req, fetch) -> None:
        """A compressed prompt that came in: into new blocks, kept in memory, adopted by req. Nothing came, no room,
        or payloads this pool does not take: req computes its prompt."""
        kv = self.kv
        n = len(fetch.payloads) if fetch is not None else 0
        if not n:
            return
        if not kv.make_room(n):
            return
        ids = kv.allocator.allocate(n)
        kv.peak_blocks_used = max(kv.peak_blocks_used, kv.allocator.num_used)
        try:
            kv.connector.block_io.import_blocks(ids, fetch.payloads)
        except ValueError:
            kv.allocator.decref(ids)
            return
        kv.compressed.store(req.cache_salt, req.token_ids[:fetch.num_tokens], [ids], fetch.rows, fetch.policy_state)
        kv.allocator.decref(ids)  # the kept entry holds them (or these go back)
        entry = kv.compressed.match(req.cache_salt, req.token_ids)
        if entry is not None:
            kv.adopt_compressed(req, entry)
            kv.connector.adopted_compressed(fetch)

    def cancel(self, state: RequestKV) -> None:
        if state.load is not None:
            self.kv.allocator.decref(state.load.block_ids)
            self.kv.connector.cancel(state.load)
            state.load = None

    # -- swap -------------------------------------------------------------------------------------------

    def can_swap_in(self, req) -> bool:
        """Room for the request's blocks and one more (its next token), idle prefix-cache blocks reclaimed for it;
        without that a swapped request could wait forever behind blocks nobody uses."""
        kv = self.kv
        if kv.state_pool is not None and kv.state_pool.num_free == 0:
            return False  # its recurrent state needs a slot too
        need = min(kv.connector.swapped_blocks(req.request_id) + 1, kv.allocator.num_blocks)
        return kv.make_room(need)

    def swap_out(self, req) -> bool:
        """Move req's blocks out through the connector and free them; False when there is nothing to swap to."""
        kv = self.kv
        state = kv.requests.get(req.request_id)
        if kv.connector is None or state is None or state.load is not None:
            return False
        table = state.block_table[:blocks_for_tokens(kv.cache_len(req), kv.block_size)]
        slot = state.state_slot
        saved = kv.state_pool.export_slot(slot) if slot is not None else None
        resume = Resume(req.num_computed_tokens, state.num_evicted, state.policy_state, saved)
        if not kv.connector.swap_out(req.request_id, table, resume):
            return False  # e.g. the store queue is full: preempt by recompute instead
        kv.release(req, cache=False)
        return True

    def swap_in(self, req) -> int:
        """Reserve blocks for a swapped request and start fetching them; returns its computed tokens."""
        kv = self.kv
        ids = kv.allocator.allocate(kv.connector.swapped_blocks(req.request_id))
        load = kv.connector.swap_in(req.request_id, ids)
        state = kv._state(req)
        if kv.state_pool is not None:
            state.state_slot = kv.state_pool.allocate()  # zeroed; it gets the saved state when that comes in
        state.num_evicted, state.policy_state = load.resume.num_evicted, load.resume.policy_state
        state.num_matched, state.load = load.matched, load
        return load.matched

    def _finish_swap_in(self, state: RequestKV, load: Transfer, payloads: list) -> None:
        kv = self.kv
        if all(p is not None for p in payloads):
            state.block_table.extend(load.block_ids)
            kv._restage(state, [state.num_matched - state.num_evicted])  # its window as it was, before its blocks come in
        if not kv.connector.finish_swap_in(load, payloads):
            kv.allocator.decref(load.block_ids)
            state.num_matched = state.num_evicted = 0
            state.policy_state = None
            return  # a recurrent state slot stays zeroed: the state before any token
        if state.state_slot is not None:
            kv.state_pool.import_slot(state.state_slot, load.resume.state)
        kv.park(state)  # until it runs again: a running request's claim may take these entries first
