"""KVzip's scoring pass: the model repeats a sequence's context after it; the attention each cached pair receives."""
from __future__ import annotations

import torch

from kvforge.engine.scheduler import ScheduledBatch
from kvforge.errors import OutOfKVMemoryError


@torch.inference_mode()
def reconstruction_scores(runner, seq, repeat: list[int], chunk: int, per_head: bool) -> torch.Tensor:
    """Each cached pair's largest attention while the model repeats seq's context, [layers, kv heads (1 unless
    per_head), 1, cache_len]. As in KVzip's chunked scoring, the context is repeated `chunk` tokens at a time: each
    forward feeds `repeat` + one chunk after the whole cache, and its rows are dropped before the next, so the pass
    needs room for len(repeat) + chunk rows (with less free, the chunk halves until it fits). Afterwards seq's tokens, computed count and blocks are as before."""
    kv = runner.kv
    length, computed = kv.cache_len(seq), seq.num_computed_tokens
    if length != computed:
        raise ValueError("kvzip: the scoring pass runs before any eviction (every context token still cached)")
    saved, context = seq.token_ids, list(seq.token_ids[:computed])
    best, start = None, 0
    try:
        while start < computed:
            extra = list(repeat) + context[start: start + chunk]
            seq.token_ids = context + extra
            if not kv.allocate_slots(seq, len(extra), prompt_window=False):
                if chunk == 1:
                    raise OutOfKVMemoryError(f"kvzip: the KV cache cannot hold the scoring pass ({computed + len(extra)} "
                                             "rows: the context, the instruction and one token); give more KV memory")
                chunk //= 2  # less room than `chunk` rows: repeat shorter chunks
                continue
            _, _, stats = runner.forward(ScheduledBatch([seq], [len(extra)]))
            kv.rollback(seq)  # the pass's blocks go back; rows past the context in its last block are void
            found = stats.layer_attention(0, per_head=per_head)[0][..., :length]
            best = found if best is None else torch.maximum(best, found)
            start += chunk
    finally:
        seq.token_ids = saved
        kv.rollback(seq)
    return best
