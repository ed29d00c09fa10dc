"""Score every position of a token sequence through the engine's own cache (decode-faithful).

Tokens go through the model in chunks; each chunk's queries attend to the history as it is
stored in the cache (in the cache's format). Chunks default to one cache block, aligned to block
boundaries: then every query sees what token-by-token decode would show it, earlier blocks as
stored and its own block as just written (formats with fp16 staging keep the block being filled
exact). Longer chunks let a query see its own block already quantized, which decode never does.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from kvforge.engine.scheduler import ScheduledBatch
from kvforge.engine.sequence import Sequence
from kvforge.errors import OutOfKVMemoryError
from kvforge.sampling_params import SamplingParams


@torch.inference_mode()
def iter_chunk_logits(engine, token_ids: list[int], chunk_size: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (start, logits [n, vocab]) for consecutive chunks; logits[i] predicts token start + i + 1."""
    seq = Sequence("score", None, token_ids, SamplingParams(max_tokens=1), 0.0)
    runner, kv = engine.runner, engine.kv
    chunk_size = chunk_size or kv.block_size
    try:
        for start in range(0, len(token_ids), chunk_size):
            n = min(chunk_size, len(token_ids) - start)
            if not kv.allocate_slots(seq, n, prompt_window=False):  # fp16 windows as decode has them
                raise OutOfKVMemoryError(f"the KV cache cannot hold {start + n} tokens of this sequence")
            batch = ScheduledBatch([seq], [n])
            hidden, _, stats = runner.forward(batch)
            engine.commit(batch, stats)  # the KV policy runs between chunks
            yield start, runner.model.compute_logits(hidden).float()
    finally:
        kv.free(seq)


def position_logits(engine, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
    """Logits at every position, [len(token_ids), vocab]."""
    return torch.cat([logits for _, logits in iter_chunk_logits(engine, token_ids, chunk_size)])
