"""SpeculativeDecoder: proposes drafts before a step (as many as the planner allows), verifies after it, counts.

Drafts never sit on a sequence: `propose` returns them to the engine, the scheduler puts those that fit in the
step's batch, a model drafter fills its reserved positions there, and verification reads them from there."""
from __future__ import annotations

import time

import torch

from kvforge.engine.sampler import check_finite, target_probs
from kvforge.engine.scheduler import ScheduledBatch
from kvforge.engine.speculative.model_drafter import PENDING, ModelDrafter
from kvforge.engine.speculative.ngram import NgramIndex
from kvforge.engine.speculative.planner import Candidate, SpeculationPlanner
from kvforge.engine.speculative.verify import verify_greedy, verify_sampled
from kvforge.engine.step_cost import StepCost
from kvforge.speculative_config import SpeculativeConfig


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, length_limit: int, evictor=None, drafter: ModelDrafter | None = None,
                 step_cost: StepCost | None = None, kv=None):
        """drafter: the model that drafts (layer_skip, draft); None drafts by prompt lookup (ngram).
        step_cost: the target's cost of a step by rows, from the model runner (None: verify_row_cost per row).
        kv: the KV cache manager, whose staged formats bound drafts to the block being filled (`draft_room`)."""
        self.config, self.length_limit, self.evictor, self.drafter = config, length_limit, evictor, drafter
        self.kv = kv
        k = config.num_speculative_tokens
        self.num_drafts = 0  # (sequence, step) pairs that verified at least one drafted token
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * k
        self.drafted_per_position = [0] * k
        self.draft_seconds = 0.0
        self.ngrams: dict[str, NgramIndex] = {}  # each running sequence's n-gram index (method ngram)
        self.num_skipped_batch_size = 0  # sequence-steps without drafts because disable_by_batch_size was reached
        cost = step_cost if step_cost is not None else StepCost(config.verify_row_cost)
        self.planner = SpeculationPlanner(cost, config.acceptance_smoothing, config.probe_interval,
                                          config.max_probe_interval, drafter.cost_fraction if drafter else 0.0
                                          ) if config.adaptive else None

    def propose(self, running: list) -> dict[str, list[int]]:
        """Drafts of each decoding sequence that should draft in the coming step, by request id. A model drafter's
        are PENDING positions; `draft` chooses the tokens of those the scheduler kept."""
        start = time.perf_counter()
        c = self.config
        active = len(running) < c.disable_by_batch_size
        num_decoding, offers = 0, []
        for seq in running:
            if seq.num_computed_tokens != seq.num_tokens - 1:
                continue  # still prefilling
            num_decoding += 1
            if seq.params.has_penalties:
                continue  # penalties depend on every token before a position: such sequences decode one by one
            if not active:
                self.num_skipped_batch_size += 1
                continue
            room = min(seq.params.max_tokens - seq.num_output_tokens, self.length_limit - seq.num_tokens) - 1
            k = min(c.num_speculative_tokens, room)
            if self.evictor is not None and k > 0:  # stop where token-by-token decoding would compact the cache
                k = self.evictor.tokens_before_compaction(seq, k + 1) - 1
            room = self.kv.draft_room(seq) if self.kv is not None and k > 0 else None
            if room is not None:  # stop where token-by-token decoding would move the fp16 window of a staged format
                k = min(k, room)
            if k > 0 and self.drafter is not None:
                offers.append((seq, [PENDING] * k))
            elif k > 0:
                index = self.ngrams.get(seq.request_id)
                if index is None:
                    index = self.ngrams[seq.request_id] = self.new_index(seq)
                offers.append((seq, index.propose(seq.token_ids, k)))
        if len(self.ngrams) > len(running):
            alive = {seq.request_id for seq in running}
            self.ngrams = {key: index for key, index in self.ngrams.items() if key in alive}
        if self.planner is not None:
            self.planner.retain({seq.request_id for seq in running})
            plan = self.planner.plan([Candidate(seq.request_id, len(d)) for seq, d in offers], num_decoding)
            offers = [(seq, d[:plan[seq.request_id]]) for seq, d in offers]
        self.draft_seconds += time.perf_counter() - start
        return {seq.request_id: drafts for seq, drafts in offers if drafts}

    def new_index(self, seq) -> NgramIndex:
        """The n-gram index of a sequence that starts drafting by prompt lookup (`bench spec` swaps in its ceiling)."""
        return NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)

    def draft(self, batch: ScheduledBatch, meta, device: torch.device) -> dict[str, list[int]]:
        """After scheduling: the model drafter's tokens for the positions the step reserved. batch: the sequences with
        drafts, each running its last token and drafts; meta: those rows as the target will run them."""
        start = time.perf_counter()
        drafted = self.drafter.draft([seq.token_ids[-1] for seq in batch.seqs],
                                     [len(batch.drafts(seq)) for seq in batch.seqs], meta, device)
        self.draft_seconds += time.perf_counter() - start
        return {seq.request_id: tokens for seq, tokens in zip(batch.seqs, drafted)}

    def observe(self, input_ids: torch.Tensor, meta) -> None:
        """The target ran a forward: a drafter with its own cache mirrors it."""
        if self.drafter is not None:
            start = time.perf_counter()
            self.drafter.observe(input_ids, meta)
            self.draft_seconds += time.perf_counter() - start

    def rollback(self, seq, kv) -> None:
        """seq's cache was cut back after rejected drafts: the drafter's own cache follows."""
        if self.drafter is not None:
            self.drafter.rollback(seq, kv.cache_len(seq), kv.block_table(seq), kv.block_size)

    def verify(self, seq, logits: torch.Tensor, drafts: list[int]) -> list[int]:
        """logits [len(drafts) + 1, vocab] of seq's last rows -> the tokens it emits this step."""
        check_finite(logits)
        if seq.params.greedy:
            out = verify_greedy(logits, drafts)
        else:
            out = verify_sampled(target_probs(logits, seq), drafts, seq.generator)
        self._record(seq, len(drafts), len(out) - 1)
        return out

    def _record(self, seq, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for i in range(drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < accepted
        if self.planner is not None:
            self.planner.record(seq.request_id, drafted, accepted)

    def stats(self) -> dict:
        drafts, drafted = self.num_drafts, self.num_draft_tokens
        return {
            "spec_method": self.config.method,
            "spec_num_drafts": drafts,
            "spec_num_draft_tokens": drafted,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.num_accepted_tokens / drafted if drafted else 0.0,
            "spec_mean_acceptance_length": 1 + self.num_accepted_tokens / drafts if drafts else 1.0,
            "spec_acceptance_per_position": [a / d if d else 0.0 for a, d in
                                             zip(self.accepted_per_position, self.drafted_per_position)],
            "spec_draft_seconds": self.draft_seconds,
            "spec_num_skipped_batch_size": self.num_skipped_batch_size,
            **(self.planner.stats() if self.planner is not None else {}),
            **(self.drafter.stats() if self.drafter is not None else {}),
        }
