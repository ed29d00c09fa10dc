"""ModelRunner: turns a scheduled batch into tensors, runs the model, samples. It changes no request state: a model
drafter's tokens go into the step's batch, the step's outputs into a StepResult."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvforge.attention import AttentionMetadata
from kvforge.engine.sampler import sample, top_logprobs
from kvforge.engine.scheduler import ScheduledBatch
from kvforge.engine.step_cost import StepCost
from kvforge.kv.manager import KVCacheManager
from kvforge.kv.policies.stats import AttentionStats
from kvforge.models.bridged import bridged_rows
from kvforge.ops.layer_bridge import BRIDGE_ROWS


@dataclass
class StepResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)  # request id -> tokens it emits (more with speculation)
    logprobs: dict[str, list[dict]] = field(default_factory=dict)  # request id -> top logprobs of each of them
    stats: AttentionStats | None = None  # attention a KV policy asked for
    errors: dict[str, Exception] = field(default_factory=dict)  # request id -> why its token could not be sampled


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCacheManager, device: torch.device,
                 layer_windows: list[int | None] | None = None, detokenize=None):
        self.model, self.kv, self.device = model, kv, device
        self.layer_windows = layer_windows if layer_windows is not None else [None] * kv.spec.num_layers  # per KV layer
        self.detokenize = detokenize
        self.forward_tokens = 0  # tokens pushed through the model, for FLOP accounting
        self.sampled_tokens = 0
        self.attended_keys = 0  # sum over query tokens of the keys each attended to
        self.forward_passes = 0  # each reads every weight once: the memory side of the roofline
        self.context_rows = 0  # sum over forwards and sequences of the cached rows attention reads
        self.evictor = None  # kvforge.kv.policies.Evictor when a KV policy evicts
        self.speculator = None  # kvforge.engine.speculative.SpeculativeDecoder when speculative decoding is on

    def bridge_rows(self) -> int | None:
        """Most rows of a step the model runs through the compiled layer bridge's streamed path (models/bridged.py),
        None where it does not (another architecture, the per-op path forced, the kernels not built)."""
        return BRIDGE_ROWS if bridged_rows(self.model, 1) is not None else None

    def step_cost(self, row_cost: float, jump: float = 0.0, row_cost_above: float | None = None) -> StepCost:
        """What a step of this model costs by its rows, from the measured constants: one line, or two on either side
        of the layer bridge's row limit where the bridge serves the model."""
        return StepCost(row_cost, self.bridge_rows(), jump, row_cost_above)

    def build_metadata(self, batch: ScheduledBatch) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
        kv, bs, groups = self.kv, self.kv.block_size, self.kv.groups
        input_ids, positions, sample_rows = [], [], []
        slots, ctx_lens, tables = ([[] for _ in groups] for _ in range(3))
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            drafts = batch.drafts(seq)
            tokens = seq.token_ids + drafts if drafts else seq.token_ids
            input_ids.extend(tokens[start:end])
            positions.extend(self.evictor.positions(seq, n) if self.evictor else range(start, end))
            for g, group in enumerate(groups):
                cache_start = kv.group_cache_len(seq, g)  # == start unless a KV policy evicted tokens
                skip = group.first_needed_block(cache_start, bs)  # a sliding group's blocks behind the window
                slots[g].extend(kv.slots(seq, cache_start, cache_start + n, g))
                ctx_lens[g].append(cache_start + n - skip * bs)
                tables[g].append(kv.block_table(seq, g)[skip:])
            if end == len(tokens):  # the last row, and one per draft before it, predict new tokens
                sample_rows.extend(range(len(input_ids) - 1 - len(drafts), len(input_ids)))
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        stats = self.evictor.stats_request(batch.seqs, batch.num_new_tokens, [len(batch.drafts(s)) for s in batch.seqs]
                                           ) if self.evictor else None
        slot_tensors = [torch.tensor(s, dtype=torch.long, device=dev) for s in slots]
        views: dict[tuple[int, int | None], AttentionMetadata] = {}
        state_slots = [kv.state_slot(seq) for seq in batch.seqs] if kv.state_pool is not None else None
        cuts = [kv.checkpoint_cuts(seq, n) + (list(range(1, n)) if batch.drafts(seq) else [])  # a state per draft
                for seq, n in zip(batch.seqs, batch.num_new_tokens)] if state_slots else None  # row: rollback
        for layer, window in enumerate(self.layer_windows or [None]):  # a model without attention: one view
            g = kv.group_of_layer.get(layer, 0)
            if (g, window) not in views:
                views[g, window] = AttentionMetadata(
                    slot_mapping=slot_tensors[g], positions=pos, query_lens=list(batch.num_new_tokens),
                    context_lens=ctx_lens[g], block_tables=tables[g], block_size=bs, sliding_window=window,
                    stats=None if groups[g].sliding else stats,  # KV policies see full-attention layers only
                    state_slots=state_slots, state_cuts=cuts if cuts and any(cuts) else None)
        meta = next((v for v in views.values() if v.stats is stats), next(iter(views.values())))
        if len(views) > 1:
            meta.layer_views = [views[kv.group_of_layer[i], w] for i, w in enumerate(self.layer_windows)]
        return torch.tensor(input_ids, dtype=torch.long, device=dev), meta, sample_rows

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int], AttentionStats | None]:
        """Push the batch's new tokens through the model (their K/V enter the cache): hidden states
        [T, hidden], the rows of sequences that reached their last token, and the attention a KV policy asked for."""
        input_ids, meta, sample_rows = self.build_metadata(batch)
        if self.kv.state_pool is not None:
            self.kv.state_pool.take_captured()  # a failed step's copies are not this step's
        hidden = self.model(input_ids, meta, self.kv.pool)
        if self.speculator:
            self.speculator.observe(input_ids, meta)
        self.forward_tokens += input_ids.shape[0]
        self.forward_passes += 1
        self.context_rows += sum(meta.context_lens)
        self.attended_keys += sum(n * c - n * (n - 1) // 2 for n, c in zip(meta.query_lens, meta.context_lens))
        return hidden, sample_rows, meta.stats

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Run one step: the sampled token (and top logprobs, when asked) of each sequence that reaches its last token;
        with drafts, the tokens verification accepts plus the target's next."""
        if self.speculator and self.speculator.drafter is not None and batch.draft_token_ids:
            self._draft(batch)
        hidden, sample_rows, stats = self.forward(batch)
        result = StepResult(stats=stats)
        drafts = [batch.drafts(s) for s in batch.seqs]
        sampled = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
                   if s.num_computed_tokens + n == s.num_tokens + len(drafts[i])]
        sampled_seqs, drafts = [batch.seqs[i] for i in sampled], [drafts[i] for i in sampled]
        if not sampled_seqs:
            return result
        logits = self.model.compute_logits(hidden[sample_rows]).float()
        rows, first = [], 0
        for seq_drafts in drafts:
            rows.append(range(first, first + 1 + len(seq_drafts)))
            first += 1 + len(seq_drafts)
        plain = [i for i in range(len(sampled_seqs)) if not drafts[i]]
        plain_rows = [rows[i][0] for i in plain]
        plain_logits = logits if len(plain_rows) == len(logits) else logits[plain_rows]  # no drafts: every row, no copy
        plain_tokens, plain_failed = sample(plain_logits, [sampled_seqs[i] for i in plain]) if plain else ([], {})
        emitted = {i: [t] for r, (i, t) in enumerate(zip(plain, plain_tokens)) if r not in plain_failed}
        result.errors = {sampled_seqs[plain[r]].request_id: e for r, e in plain_failed.items()}
        for i, seq in enumerate(sampled_seqs):
            if drafts[i]:
                try:
                    emitted[i] = self.speculator.verify(seq, logits[rows[i].start: rows[i].stop], drafts[i])
                except Exception as e:  # noqa: BLE001 - e.g. NaN logits: this request fails, not the step
                    result.errors[seq.request_id] = e
        for i, seq in enumerate(sampled_seqs):
            if i not in emitted:
                continue
            toks = emitted[i]
            self.sampled_tokens += len(toks)
            result.tokens[seq.request_id] = toks
            if seq.params.logprobs is not None:
                result.logprobs[seq.request_id] = [top_logprobs(logits[rows[i][j]], t, seq.params.logprobs, self.detokenize)
                                                   for j, t in enumerate(toks)]
        return result

    def _draft(self, batch: ScheduledBatch) -> None:
        """A model drafter chooses the tokens of the draft positions the scheduler reserved, over the rows the target
        then runs (so evicting policies' positions apply)."""
        drafting = batch.drafting()
        _, meta, _ = self.build_metadata(drafting)
        batch.draft_token_ids.update(self.speculator.draft(drafting, meta, self.device))
