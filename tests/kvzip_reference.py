"""Shared by the kvzip reuse tests: the answer to a question after a context compressed on its own, computed by hand."""
from __future__ import annotations

import torch

from kvforge.engine.scheduler import ScheduledBatch
from kvforge.engine.sequence import Sequence
from kvforge.sampling_params import SamplingParams


@torch.inference_mode()
def recompressed(engine, context: list[int], question: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """The context compressed on its own (its prompt), then the question and greedy tokens after it: their ids and
    logprobs."""
    seq = Sequence("ref", None, list(context), SamplingParams(max_tokens=1), 0.0)
    seq.token_ids = context + question
    runner, kv, ids, lps = engine.runner, engine.kv, [], []
    try:
        for n in [len(context), len(question)] + [1] * (max_tokens - 1):
            assert kv.allocate_slots(seq, n, prompt_window=False)
            batch = ScheduledBatch([seq], [n])
            hidden, _, stats = runner.forward(batch)
            engine.commit(batch, stats)
            if n == len(question) or len(ids):
                logp = torch.log_softmax(runner.model.compute_logits(hidden[-1:]).float(), -1)[0]
                ids.append(int(logp.argmax()))
                lps.append(float(logp.max()))
                seq.token_ids.append(ids[-1])
    finally:
        kv.free(seq)
    return ids, lps
