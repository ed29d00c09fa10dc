"""StagingWindows: which blocks may hold a staged format's fp16 staging entries (a mixin of KVCacheManager).

Each request keeps the last `stage_blocks` blocks of each KV group's table in fp16 (its window, counted from the
end of the tokens it knows; the block being filled always stages). When a block leaves its request's window it
is encoded from its fp16 rows (now, or at the end of the write that fills it); a freed block drops its entries.
Blocks adopted from the prefix cache read as codes (`_adopt`), prefill chunks end on block boundaries
(`align_chunk`) and drafts within the block being filled (`draft_room`), so what a request reads depends on its
own tokens and the cached blocks it adopted, never on other requests, on chunking or on speculation.
The pool holds `max_num_seqs` windows per group, and only running requests hold one (a swapped-in request
waiting for a slot is parked, a compacting one parks its old window), so a claim never needs an entry of a
block in a window: it takes a free one or one of a block outside every window (encoding that block).
"""
from __future__ import annotations

from kvforge.kv.groups import NULL_BLOCK


class StagingWindows:
    """Needs the manager's pool, allocator, block_size, format, spec and `staging_pools` (pools sharing may_stage)."""

    @property
    def stage_blocks(self) -> int:
        return self.format.stage_blocks(self.spec, self.block_size) if self.pool.may_stage is not None else 0

    def align_chunk(self, req, n: int) -> int:
        """Where the format stages, a prefill chunk of up to n tokens that leaves some of req's tokens for later
        ends on a block boundary (0: none is in reach): with windows counted from the prompt's end, the prompt then
        reads the same wherever the step's token budget cuts it."""
        if not self.stage_blocks or n >= req.num_tokens - req.num_computed_tokens:
            return n
        return max(0, n - (self.cache_len(req) + n) % self.block_size)

    def draft_room(self, req) -> int | None:
        """Drafts that fit after req's next token in the block that token falls in, where the format keeps fp16
        windows (else None): verifying drafts past it would move the window before token-by-token decoding does."""
        if not self.stage_blocks:
            return None
        bs = self.block_size
        return min(bs - 1 - self.group_cache_len(req, g) % bs for g in range(len(self.groups)))

    def stage_for_compaction(self, req, num_rows: int) -> None:
        """Before a KV policy moves req's kept rows to its first `num_rows` slots: the blocks of its window after the
        move stage (rows landing there stay fp16); the old window's other blocks keep their entries to be read from
        but give them up first to a claim, and `truncate` then lets them go."""
        state = self.requests.get(req.request_id)
        n, bs = self.stage_blocks, self.block_size
        if state is None or not n or num_rows <= 0:
            return
        window = []
        for g in self.full_groups:
            start = max((num_rows - 1) // bs - n + 1, state.num_adopted // bs)
            window += [b for b in state.block_tables[g][start:(num_rows - 1) // bs + 1] if b != NULL_BLOCK]
        old = [b for b in state.staged if b not in set(window)]
        if old:
            self.pool.may_stage[old] = False
        if window:
            self.pool.may_stage[window] = True
        state.staged = old + [b for b in window if b not in set(old)]

    def park(self, state) -> None:
        """state's request holds its blocks but does not run (swapped in, waiting for a slot): its staged blocks
        keep their rows but give their entries up first to a running request's claim (and are encoded then)."""
        if state.staged:
            self.pool.may_stage[state.staged] = False
            state.parked = True

    def _adopt(self, block_ids: list[int]) -> list[int]:
        """Cached blocks a request takes over (a reference each), as they will read once their owners move on: a
        block still in its owner's fp16 window is copied into a new block of the adopter's instead, encoded from
        those rows as the owner's flush will encode it. (With no free block for the copy the block is shared as it
        is, and reads fp16 until its owner moves on.)"""
        mask = self.pool.may_stage
        live = [b for b in block_ids if mask is not None and bool(mask[b])]
        if live and not self.allocator.can_allocate(len(live)):
            self._reclaim(len(live) - self.allocator.num_free)
        if not live or not self.allocator.can_allocate(len(live)):
            self.allocator.incref(block_ids)
            return list(block_ids)
        copies = dict(zip(live, self.allocator.allocate(len(live))))
        for pool in self.staging_pools:
            pool.import_blocks(list(copies.values()), pool.export_blocks(live))
        self.allocator.incref([b for b in block_ids if b not in copies])
        return [copies.get(b, b) for b in block_ids]

    def _restage(self, state, ends: list[int], writing: list[int] | None = None,
                 finals: list[int] | None = None) -> None:
        """state's window once its tables' caches end at `ends` (per group), counted back from `finals` (where the
        tokens it knows end: a prompt's end while it is prefilled in chunks; default `ends`), plus the block being
        filled. Blocks leaving it are encoded now unless they are free or written this step (from token `writing`
        of each group on): their write encodes them once it has filled them."""
        n = self.stage_blocks
        if not n:
            return
        bs, old = self.block_size, state.staged
        window: list[int] = []
        busy: set[int] = set()
        for g, (table, end) in enumerate(zip(state.block_tables, ends)):
            if end > 0:
                last = (end - 1) // bs
                start = max(((finals[g] if finals else end) - 1) // bs - n + 1, state.num_adopted // bs)
                start = min(start, last) if end % bs else start  # a block being filled always stages
                window += [b for b in table[start:last + 1] if b != NULL_BLOCK]
            if writing is not None:
                busy.update(table[writing[g] // bs:])
        if window == old and not state.parked:
            return
        state.staged, state.parked = window, False
        mask = self.pool.may_stage
        if window:
            mask[window] = True
        inside = set(window)
        left = [b for b in old if b not in inside]
        if not left:
            return
        mask[left] = False
        free = [b for b in left if self.allocator.ref_counts[b] == 0]
        done = [b for b in left if self.allocator.ref_counts[b] > 0 and b not in busy]
        for pool in self.staging_pools:
            pool.forget_blocks(free)
            pool.unstage(done)

    def _unstage_all(self, state) -> None:
        """state's request holds no window and no sink pin any more (finished, preempted, swapped out)."""
        self._restage(state, [0] * len(state.block_tables))
        self._repin(state, released=True)

    def _repin(self, state, released: bool = False) -> None:
        """Pin the first block of each of state's tables (a running request's sink rows are never claimed away)."""
        pins = self.pool.sink_pins
        if pins is None:
            return
        now = [] if released else [t[0] for t in state.block_tables if t and t[0] != NULL_BLOCK]
        if now != state.pinned:
            if state.pinned:
                pins[state.pinned] -= 1
            if now:
                pins[now] += 1
            state.pinned = now
