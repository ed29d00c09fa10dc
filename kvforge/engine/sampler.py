"""Sampler: greedy, temperature, top-k, top-p, with per-request seeded generators."""
from __future__ import annotations

import torch

from kvforge.engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One next token per row of logits [N, vocab] (fp32)."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, seq in enumerate(seqs):
        if not seq.params.greedy:
            tokens[row] = _sample_row(logits[row], seq)
    return tokens


def _sample_row(logits: torch.Tensor, seq: Sequence) -> int:
    return int(torch.multinomial(_probs(logits, seq).cpu(), 1, generator=seq.generator).item())


def target_probs(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The distribution seq samples from at each row of logits [N, vocab] (temperature, top-k, top-p applied)."""
    probs = torch.stack([_probs(row, seq) for row in logits]).cpu()
    return probs / probs.sum(-1, keepdim=True)


def _probs(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(0) - sorted_probs > p.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


def top_logprobs(logits: torch.Tensor, token: int, k: int, decode) -> dict:
    """Log-probability of the chosen token and the k most likely alternatives."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logp, k) if k > 0 else None
    return {
        "token_id": token,
        "token": decode([token]),
        "logprob": float(logp[token]),
        "top": [] if top is None else [
            {"token_id": int(i), "token": decode([int(i)]), "logprob": float(v)} for v, i in zip(top.values, top.indices)
        ],
    }
