"""Verification: which drafted tokens the target model accepts, and the token it adds.

Greedy: accept drafts while each equals the target's argmax, then add the target's own next token.
Sampling: the rejection rule of Leviathan et al. 2023 (arXiv:2211.17192) and Chen et al. 2023
(arXiv:2302.01318), so the output follows the target distribution exactly. A draft token d proposed
with probability q(d) is accepted with probability min(1, p(d) / q(d)); on rejection the token is
drawn from max(p - q, 0), renormalised. Drafters here are deterministic (q is a point mass on d), so
acceptance is p(d) and the residual is p with d removed.
"""
from __future__ import annotations

import torch


def verify_greedy(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """logits [len(drafts) + 1, vocab] -> the accepted drafts plus the target's next token."""
    target = logits.argmax(-1).tolist()
    out = []
    for d, t in zip(drafts, target):
        if d != t:
            break
        out.append(d)
    out.append(target[len(out)])
    return out


def verify_sampled(probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None) -> list[int]:
    """probs [len(drafts) + 1, vocab], the target's sampling distribution at each position."""
    out = []
    for i, d in enumerate(drafts):
        p = probs[i]
        if float(torch.rand((), generator=generator)) < float(p[d]):
            out.append(d)
            continue
        residual = p.clone()
        residual[d] = 0.0
        if float(residual.sum()) <= 0.0:  # the target puts all its mass on d: never rejected in exact arithmetic
            out.append(d)
            continue
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return out
