"""RecurrentStates (a mixin of the KVCacheManager): each request's recurrent state slot and the prefix cache's
state checkpoints, for models with Mamba-2 or short-conv layers.

A request takes a slot (kv/state_pool.py) when it is first given blocks, or at a prefix hit, where the slot is
loaded from the checkpoint of the deepest cached node (kv/state_checkpoints.py); `release` gives it back. During
prefill the runner asks `checkpoint_cuts` where the layers should copy the state, and after the step
`store_checkpoints` keeps the copies under the prefixes they follow. With a KV connector (tiers) a checkpoint also
goes there when it is taken and when the in-memory LRU evicts it, and a prefix load brings the deepest one back
(kvforge.kv.transfers).
"""
from __future__ import annotations

import weakref

import torch

from kvforge.kv.groups import StateGroup, state_bytes_per_sequence
from kvforge.kv.request_kv import RequestKV
from kvforge.kv.state_checkpoints import StateCheckpoints, checkpoint_key
from kvforge.kv.state_pool import StatePool

_NONE = RequestKV()


class RecurrentStates:
    def _init_states(self, state_groups: list[StateGroup], max_num_seqs: int, device: torch.device, caching: bool,
                     checkpoint_memory: int, checkpoint_interval: int) -> None:
        self.state_groups = list(state_groups)
        self.state_pool = StatePool(self.state_groups, max_num_seqs, device) if self.state_groups else None
        self.pool.state = self.state_pool  # the models read their layers' states there
        self.state_bytes_per_sequence = state_bytes_per_sequence(self.state_groups)
        self.checkpoints = (StateCheckpoints(checkpoint_memory, self.state_bytes_per_sequence, checkpoint_interval)
                            if self.state_pool is not None and caching else None)

    def _attach_checkpoint_tiers(self) -> None:
        """Checkpoints the LRU evicts go to the connector's write-back tiers."""
        if self.checkpoints is not None:
            manager = weakref.proxy(self)  # no cycle through the store's callback
            self.checkpoints.on_evict = lambda key, checkpoint: manager._offer_checkpoint(key, checkpoint, False)
            self.connector.held_checkpoints = manager._held_checkpoints  # what close persists with the blocks

    def _held_checkpoints(self) -> list[tuple[list[int], str | None, object]]:
        """The checkpoints in memory as (tokens, salt, payload maker), most recently used first."""
        pool = self.state_pool
        return [(list(tokens), salt, lambda c=checkpoint: pool.checkpoint_payload(c))
                for (salt, tokens), checkpoint in self.checkpoints.items()]

    def _offer_checkpoint(self, key, checkpoint, taken: bool) -> None:
        salt, tokens = key
        self.connector.on_checkpoint(list(tokens), salt, lambda: self.state_pool.checkpoint_payload(checkpoint), taken)

    def state_slot(self, req) -> int | None:
        """req's slot in the recurrent state pool (None without recurrent layers or before allocate_slots)."""
        return self.requests.get(req.request_id, _NONE).state_slot

    def _deepest_checkpoint(self, tokens, salt, num: int) -> int:
        """The most of the first `num` cached tokens a recurrent model can resume from (a checkpoint's depth)."""
        if self.checkpoints is None:
            return 0
        for n in range(num // self.block_size * self.block_size, 0, -self.block_size):
            if checkpoint_key(salt, tokens[:n]) in self.checkpoints:
                return n
        return 0

    def _resume_state(self, req, tokens, num: int, count: bool) -> int:
        """req resumes after `num` tokens: take its state slot and load the checkpoint there (0 without a free slot).
        `count`: a first match, whose shortfall against the cached KV the stats count."""
        if count:
            self._count_short(num, min(tree.peek_prefix(tokens, req.cache_salt) for tree in self.prefix_trees))
        if self.state_pool.num_free == 0:
            return 0
        state = self._state(req)
        state.state_slot = self.state_pool.allocate()
        self.state_pool.restore_layers(state.state_slot, self.checkpoints.get(checkpoint_key(req.cache_salt,
                                                                                           tokens[:num])))
        self.checkpoints.hits += 1
        return num

    def _count_short(self, resumed: int, cached: int) -> None:
        """A hit that resumed after `resumed` tokens while KV was held for `cached`: short of a checkpoint."""
        if 0 < resumed < cached:
            self.checkpoints.hits_stopped_short += 1
            self.checkpoints.tokens_lost_short += cached - resumed

    def checkpoint_cuts(self, req, num_new_tokens: int) -> list[int]:
        """After how many of req's next num_new_tokens its recurrent state should be copied: the block boundaries
        (`StateCheckpoints.boundaries`) among its known tokens that have no checkpoint yet (drafts excluded)."""
        if self.checkpoints is None:
            return []
        start, prompt_len = req.num_computed_tokens, len(req.prompt_token_ids)
        end = min(start + num_new_tokens, req.num_tokens)
        bounds = self.checkpoints.boundaries(prompt_len, start, end, self.block_size)
        return [b - start for b in bounds if checkpoint_key(req.cache_salt, req.token_ids[:b]) not in self.checkpoints]

    def rollback_state(self, req, seq_index: int, kept: int) -> None:
        """req kept only `kept` of its step's new tokens (drafts rejected): its state goes back to the copy made
        after them (the runner copies the state after each draft row)."""
        if self.state_pool is None:
            return
        saved = self.state_pool.captured.get((seq_index, kept))
        if saved is None or len(saved) != len(self.state_pool.layers):
            raise RuntimeError(f"request {req.request_id!r}: no state copy after {kept} tokens to roll back to")
        self.state_pool.restore_layers(self.state_slot(req), saved)

    def store_checkpoints(self, reqs, starts: list[int]) -> None:
        """Keep the state copies the step just made at block boundaries of computed tokens (reqs: the step's
        requests, after update_from_output; starts: their tokens computed before the step), each under the prefix
        it follows; copies after draft rows that were rejected, or not at a boundary, are dropped."""
        captured = self.state_pool.take_captured() if self.state_pool is not None else {}
        if self.checkpoints is None:
            return
        for (i, cut), checkpoint in captured.items():
            req, end = reqs[i], starts[i] + cut
            key = checkpoint_key(req.cache_salt, req.token_ids[:end])
            if end <= req.num_computed_tokens and end % self.block_size == 0 and key not in self.checkpoints:
                self.checkpoints.put(key, checkpoint)
                if self.connector is not None:
                    self._offer_checkpoint(key, checkpoint, True)

    def _state_stats(self) -> dict:
        return {
            "state_slots_total": self.state_pool.num_slots,
            "state_slots_used": self.state_pool.num_used,
            "state_bytes_per_sequence": self.state_bytes_per_sequence,
            "state_bytes_total": self.state_pool.allocated_bytes(),
            **(self.checkpoints.stats() if self.checkpoints is not None else {}),
        }
