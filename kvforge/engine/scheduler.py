"""Scheduler: continuous batching with chunked prefill and preemption by recompute.

The scheduler owns each sequence's num_computed_tokens: it sets it at admission (prefix-cache hit),
resets it on preemption, and advances it in `update_from_output` once a step's outputs are known.
Each step gives a sequence min(remaining, token budget) new tokens, so prefill chunks and decodes
share one batch; the drafts proposed for a decoding sequence count as new tokens and those that fit
travel in the step's batch (`ScheduledBatch.draft_token_ids`), never on the sequence. Running
sequences go first (oldest first); when blocks run out the newest running sequence is preempted:
its blocks are freed (or swapped to a tier) and it returns to the front of the queue. Waiting requests start in
arrival order, or with a PrefillOrder (engine/prefill_order.py) shortest remaining prefill first, in step-sized groups.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvforge.engine.prefill_order import PrefillOrder, fresh
from kvforge.engine.sequence import Sequence, SequenceStatus
from kvforge.kv.manager import KVCacheManager

LOAD_WAIT_S = 0.05


@dataclass
class ScheduledBatch:
    """What one step runs: each sequence's new tokens, the drafted tokens among them (vLLM v1's
    scheduled_spec_decode_tokens) and the sequences preempted to make room."""
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # request id -> drafts this step verifies

    def __bool__(self) -> bool:
        return bool(self.seqs)

    def add(self, seq: Sequence, num_new_tokens: int, drafts: list[int] | None = None) -> None:
        """seq runs num_new_tokens this step; the drafts that fit in them (after its real tokens) come along."""
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        fit = num_new_tokens - (seq.num_tokens - seq.num_computed_tokens)
        if drafts and fit > 0:
            self.draft_token_ids[seq.request_id] = list(drafts[:fit])

    def drafts(self, seq: Sequence) -> list[int]:
        return self.draft_token_ids.get(seq.request_id, [])

    def drafting(self) -> ScheduledBatch:
        """The sequences that verify drafts, with their last token and drafts as new tokens."""
        seqs = [seq for seq in self.seqs if seq.request_id in self.draft_token_ids]
        return ScheduledBatch(seqs, [1 + len(self.draft_token_ids[seq.request_id]) for seq in seqs],
                              draft_token_ids={seq.request_id: self.draft_token_ids[seq.request_id] for seq in seqs})


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, chunked_prefill: bool = True,
                 preemption_mode: str = "recompute", prefill_order: PrefillOrder | None = None):
        self.kv = kv
        self.prefill_order = prefill_order  # None: arrival order
        self.preemption_mode = preemption_mode
        self.recomputed_tokens = 0  # computed tokens thrown away by recompute preemptions
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []  # waiting for their prefix blocks to come in from KV tiers
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def schedule(self, drafts: dict[str, list[int]] | None = None) -> ScheduledBatch:
        """The next step's batch. drafts: request id -> tokens proposed for a decoding sequence to verify (those
        that do not fit the token budget are dropped)."""
        drafts = drafts or {}
        if self.loading:
            self._finish_loads()
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            proposed = drafts.get(seq.request_id)
            n = self._num_new_tokens(seq, budget, len(proposed) if proposed else 0)
            if n == 0:
                i += 1
                continue
            while not self.kv.allocate_slots(seq, n):
                victim = self.running.pop()
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                batch.add(seq, n, proposed)
                budget -= n
                i += 1
        if not batch.preempted:
            self._admit_waiting(batch, budget)
        return batch

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        computing: set = set()  # first blocks that sequences admitted this step are computing right now
        order, starts = self.prefill_order, None  # starts: fresh requests to start this step (None: as many as fit)
        if order is not None and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            starts = order.plan(self.waiting, self.kv.cached_prefix, budget, self.max_num_batched_tokens - budget)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            first_run = fresh(seq)
            if starts is not None and first_run and starts <= 0:
                break
            if self.kv.is_swapped(seq) and not self.kv.can_swap_in(seq):
                if not self._ready_first():
                    break
                continue
            seq.num_computed_tokens = self.kv.match_prefix(seq)
            if self.kv.is_loading(seq):
                self.waiting.popleft()
                self.loading.append(seq)
                seq.status = SequenceStatus.LOADING
                continue
            head = self.kv.uncached_head(seq)
            if head is not None and head in computing:
                break  # another request computes this block now: admit next step, re-matching what it cached
            computing.add(head)
            n = self._num_new_tokens(seq, budget)
            if n == 0 or not self.kv.allocate_slots(seq, n):
                self._release(seq)
                break
            self.waiting.popleft()
            self.kv.record_admission(seq)
            seq.metrics.cached_tokens = max(seq.metrics.cached_tokens, seq.num_computed_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
            if starts is not None and first_run:
                starts -= 1
                order.overtaken(self.waiting, seq, n)

    def _ready_first(self) -> bool:
        """Move waiting sequences that already hold their blocks (loaded or swapped in) to the front, so a swapped
        sequence waiting for room does not wait on them; False when there are none."""
        ready = [s for s in self.waiting if self.kv.block_table(s)]
        if not ready or ready == list(self.waiting)[:len(ready)]:
            return False
        for s in ready:
            self.waiting.remove(s)
        self.waiting.extendleft(reversed(ready))
        return True

    def _finish_loads(self) -> None:
        """Loaded sequences go back to the front of the queue, in order; with nothing else to run, wait a little."""
        if not self.running and not self.waiting:
            self.kv.wait_for_load(self.loading[0], LOAD_WAIT_S)
        done = [seq for seq in self.loading if self.kv.finish_load(seq)]
        for seq in reversed(done):
            self.loading.remove(seq)
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)

    def _num_new_tokens(self, seq: Sequence, budget: int, num_drafts: int = 0) -> int:
        remaining = seq.num_tokens + num_drafts - seq.num_computed_tokens
        # without chunked prefill a sequence runs whole, unless it is longer than any step (a long recompute)
        if remaining > budget and not self.chunked_prefill and remaining <= self.max_num_batched_tokens:
            return 0
        n = min(remaining, budget)
        aligned = self.kv.align_chunk(seq, n)  # staged formats: prefill chunks end on block boundaries, so a
        if aligned > 0 or budget < self.max_num_batched_tokens:  # prompt is read the same however it is cut
            n = aligned  # (0: wait for a step with room; a step that never has room cuts anywhere)
        return n

    def update_from_output(self, batch: ScheduledBatch, rejected: dict[str, int] | None = None) -> None:
        """The step ran: its new tokens' K/V are in the cache, less the drafted tokens verification rejected
        (the one place num_computed_tokens moves forward, so a rollback is one subtraction here)."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n - (rejected or {}).get(seq.request_id, 0)

    def _release(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        if not (self.preemption_mode == "swap" and self.kv.swap_out(seq)):
            self.recomputed_tokens += seq.num_computed_tokens
            self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def finish(self, seq: Sequence, cache: bool = True) -> None:
        """Remove a finished or aborted sequence and release its blocks (`cache`: full blocks stay shared)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.loading:
            self.loading.remove(seq)
        self.kv.free(seq, cache)
        seq.status = SequenceStatus.FINISHED
