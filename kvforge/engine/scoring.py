"""Score every position of a token sequence through the engine's own cache (decode-faithful).

Tokens go through the model in chunks; each chunk's queries attend to the history as it is
stored in the cache (in the cache's format), exactly as generation would see it.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from kvforge.engine.scheduler import ScheduledBatch
from kvforge.engine.sequence import Sequence
from kvforge.errors import OutOfKVMemoryError
from kvforge.sampling_params import SamplingParams


@torch.inference_mode()
def iter_chunk_logits(engine, token_ids: list[int], chunk_size: int = 128) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (start, logits [n, vocab]) for consecutive chunks; logits[i] predicts token start + i + 1."""
    seq = Sequence("score", None, token_ids, SamplingParams(max_tokens=1), 0.0)
    runner, kv = engine.runner, engine.kv
    try:
        for start in range(0, len(token_ids), chunk_size):
            n = min(chunk_size, len(token_ids) - start)
            if not kv.allocate_slots(seq, n):
                raise OutOfKVMemoryError(f"the KV cache cannot hold {start + n} tokens of this sequence")
            batch = ScheduledBatch([seq], [n])
            input_ids, meta, _ = runner.build_metadata(batch)
            hidden = runner.model(input_ids, meta, kv.pool)
            seq.num_computed_tokens += n
            if runner.evictor:  # the KV policy applies between chunks, as between decode steps
                runner.evictor.after_forward(batch.seqs, meta)
            yield start, runner.model.compute_logits(hidden).float()
    finally:
        kv.free(seq)


def position_logits(engine, token_ids: list[int], chunk_size: int = 128) -> torch.Tensor:
    """Logits at every position, [len(token_ids), vocab]."""
    return torch.cat([logits for _, logits in iter_chunk_logits(engine, token_ids, chunk_size)])
