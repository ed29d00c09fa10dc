"""Sampler: penalties, grammar masks (engine/grammar.py), greedy, temperature, top-k, top-p, min-p, with per-request
seeded generators.

A row that cannot be sampled (NaN or +inf logits, from whatever cause) fails its own request only.
"""
from __future__ import annotations

import torch

from kvforge.engine.grammar import mask_logits
from kvforge.engine.sequence import Sequence
from kvforge.ops.greedy import argmax_rows


class SamplingError(RuntimeError):
    """One request's next-token distribution could not be sampled; the other requests of the step are unaffected."""


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], dict[int, SamplingError]]:
    """One next token per row of logits [N, vocab] (fp32), and the rows that failed (their token is -1)."""
    logits = apply_penalties(logits, seqs)
    logits, refused = mask_logits(logits, seqs)  # structured output: each grammar's allowed tokens only
    tokens = argmax_rows(logits).tolist()
    broken = set(unusable_rows(logits))
    failed: dict[int, SamplingError] = {}
    for row, seq in enumerate(seqs):
        try:
            if row in refused:
                raise SamplingError(str(refused[row]))
            if row in broken:
                raise not_finite()
            if not seq.params.greedy:
                tokens[row] = _sample_row(logits[row], seq)
        except Exception as e:  # noqa: BLE001 - this row's request fails, the others keep their tokens
            failed[row] = e if isinstance(e, SamplingError) else SamplingError(f"sampling failed: {e}")
            tokens[row] = -1
    return tokens, failed


def unusable_rows(logits: torch.Tensor) -> list[int]:
    """Rows of logits [N, vocab] with a NaN or +inf, or nothing above -inf: no distribution to sample from."""
    if bool(logits.sum(-1).isfinite().all()):  # one pass: the usual case, every logit finite
        return []
    bad = logits.isnan().any(-1) | logits.isposinf().any(-1) | logits.isneginf().all(-1)
    return bad.nonzero().flatten().tolist() if bool(bad.any()) else []


def check_finite(logits: torch.Tensor) -> None:
    """SamplingError unless every row of logits [N, vocab] can be sampled from."""
    if unusable_rows(logits):
        raise not_finite()


def not_finite() -> SamplingError:
    return SamplingError("the model's logits for this request are not finite (NaN or +inf); no token can be sampled")


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Presence, frequency and repetition penalties for the rows that ask for any, in one batched pass."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.has_penalties]
    if not rows:
        return logits
    picked = [seqs[i] for i in rows]
    vocab, dev = logits.shape[-1], logits.device
    out_counts = token_counts([s.output_token_ids for s in picked], vocab, dev)
    seen = token_counts([s.token_ids for s in picked], vocab, dev) > 0
    column = (lambda name: torch.tensor([getattr(s.params, name) for s in picked], dtype=logits.dtype, device=dev)[:, None])
    rep = column("repetition_penalty")
    sub = logits[rows]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - column("frequency_penalty") * out_counts - column("presence_penalty") * (out_counts > 0)
    logits = logits.clone()
    logits[rows] = sub
    return logits


def token_counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[len(token_lists), vocab] occurrence counts (fp32), from one padded scatter_add."""
    width = max(1, max(len(t) for t in token_lists))
    ids = torch.full((len(token_lists), width), vocab, dtype=torch.long)
    for r, t in enumerate(token_lists):
        ids[r, : len(t)] = torch.tensor(t, dtype=torch.long)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, ids.to(device), torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


def _sample_row(logits: torch.Tensor, seq: Sequence) -> int:
    return int(torch.multinomial(_probs(logits, seq).cpu(), 1, generator=seq.generator).item())


def target_probs(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The distribution seq samples from at each row of logits [N, vocab] (temperature, top-k, top-p, min-p applied)."""
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
    if p.min_p > 0:  # drop tokens less likely than min_p times the most likely one (as vLLM, after top-k/top-p)
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


def top_logprobs(logits: torch.Tensor, token: int, k: int, decode) -> dict:
    """Log-probability of the chosen token and the k most likely alternatives."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    decode = decode or (lambda ids: None)  # a model without a tokenizer: ids and log-probabilities only
    top = torch.topk(logp, k) if k > 0 else None
    return {
        "token_id": token,
        "token": decode([token]),
        "logprob": float(logp[token]),
        "rank": int((logp > logp[token]).sum()) + 1,  # 1 = the most likely token (vLLM's Logprob.rank)
        "top": [] if top is None else [
            {"token_id": int(i), "token": decode([int(i)]), "logprob": float(v)} for v, i in zip(top.values, top.indices)
        ],
    }
