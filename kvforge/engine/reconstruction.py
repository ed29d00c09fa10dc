"""KVzip's scoring pass: the model repeats a sequence's context after it; the attention each cached pair receives."""
from __future__ import annotations

import torch

from kvforge.engine.scheduler import ScheduledBatch
from kvforge.errors import OutOfKVMemoryError


@torch.inference_mode()
def reconstruction_scores(runner, seq, repeat: list[int], chunk: int, per_head: bool) -> torch.Tensor:
    """Feed `repeat` + seq's context tokens after its cache, `chunk` tokens per forward, and return each cached pair's
    largest attention from those queries, [layers, kv heads (1 unless per_head), 1, cache_len]. The pass's rows
    are written to the cache as any prefill's, then dropped: seq's tokens, computed count and blocks are as before."""
    kv = runner.kv
    length, computed = kv.cache_len(seq), seq.num_computed_tokens
    if length != computed:
        raise ValueError("kvzip: the scoring pass runs before any eviction (every context token still cached)")
    saved = seq.token_ids
    extra = list(repeat) + list(saved[:computed])
    best = None
    try:
        seq.token_ids = list(saved[:computed]) + extra
        for start in range(0, len(extra), chunk):
            n = min(chunk, len(extra) - start)
            if not kv.allocate_slots(seq, n, prompt_window=False):
                raise OutOfKVMemoryError(f"kvzip: the KV cache cannot hold the scoring pass ({computed + start + n} "
                                         "rows); give a smaller `chunk` or more KV memory")
            _, _, stats = runner.forward(ScheduledBatch([seq], [n]))
            seq.num_computed_tokens += n
            found = stats.layer_attention(0, per_head=per_head)[0][..., :length]
            best = found if best is None else torch.maximum(best, found)
    finally:
        seq.token_ids, seq.num_computed_tokens = saved, computed
        kv.rollback(seq)  # the pass's blocks go back; rows past the context in its last block are void
    return best
