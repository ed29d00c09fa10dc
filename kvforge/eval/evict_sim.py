"""H2O eviction simulated on a dense cache, to measure budget layouts the paged cache cannot hold yet.

The engine keeps the same number of rows in every layer and KV head (one block table per sequence: a cache slot
holds a row of every head). Here each layer and KV head has its own mask over a dense cache of every token, so
budgets may differ per head (Ada-KV) and per layer (PyramidKV) while the total kept stays the same; with
`share="head"` and `pyramid=0` it is the engine's `h2o` with scope "head" (tests/eval/test_evict_sim.py).
Llama-family models (SmolLM2). Quality only: memory would need a per-head cache layout.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from kvforge.errors import ConfigError
from kvforge.options import json_object
from kvforge.rope import apply_rope

SHARES = ("head", "layer", "model")


@dataclass(frozen=True)
class SimConfig:
    """budget: the fraction of the tokens seen kept per layer and KV head on average (None: keep everything).
    recent: each head's newest rows kept, as a share of its even budget (H2O's recent window).
    share: what shares one pool of heavy-hitter slots chosen by score jointly: "head" (none: every layer and
        head keeps its own, as the engine), "layer" (a layer's KV heads, Ada-KV: Feng et al., arXiv:2407.11550),
        "model" (every layer and head).
    floor: with sharing, each head first keeps this share of its even heavy slots (Ada-KV's safeguard).
    pyramid: layer l's budget is scaled by 1 + pyramid * (1 - 2 l / (layers - 1)), the same total: above 0 more
        rows in the lower layers (PyramidKV: Cai et al., arXiv:2406.02069), below 0 more in the upper. In (-1, 1).
    query_heads: "sum" or "max" over the query heads of a KV head, as the h2o option."""

    budget: float | None = 0.5
    recent: float = 0.75
    share: str = "head"
    floor: float = 0.2
    pyramid: float = 0.0
    query_heads: str = "sum"
    slack: int = 16

    def __post_init__(self):
        if self.budget is not None and not (isinstance(self.budget, float) and 0 < self.budget <= 1):
            raise ConfigError(f"evict_sim: budget must be a fraction in (0, 1] or None, got {self.budget!r}")
        if not 0 <= self.recent <= 1 or not 0 <= self.floor <= 1:
            raise ConfigError(f"evict_sim: recent and floor must be in [0, 1], got {self.recent!r}, {self.floor!r}")
        if self.share not in SHARES:
            raise ConfigError(f"evict_sim: share must be one of {', '.join(SHARES)}, got {self.share!r}")
        if not -1 < self.pyramid < 1:
            raise ConfigError(f"evict_sim: pyramid must be in (-1, 1), got {self.pyramid!r}")
        if self.query_heads not in ("sum", "max"):
            raise ConfigError(f"evict_sim: query_heads must be 'sum' or 'max', got {self.query_heads!r}")

    def layer_budgets(self, seen: int, layers: int) -> list[int]:
        even = max(1, int(self.budget * seen))
        if layers == 1 or not self.pyramid:
            return [even] * layers
        return [max(1, int(even * (1 + self.pyramid * (1 - 2 * i / (layers - 1))))) for i in range(layers)]


def select_shared(scores: torch.Tensor, alive: torch.Tensor, budgets: list[int], recent: float,
                  floor: float) -> torch.Tensor:
    """One pool of units (layer, head) [U, N]: each keeps its int(recent * budget) newest alive rows and its top
    int(floor * heavy slots) others; the rest of the heavy slots (sum of budgets - recent) go to the highest
    scores of any unit. Returns the new alive mask."""
    keep = torch.zeros_like(alive)
    rest = scores.masked_fill(~alive, float("-inf"))
    slots = 0
    for u, b in enumerate(budgets):
        rows = alive[u].nonzero()[:, 0]
        r = min(int(recent * b), len(rows))
        keep[u, rows[len(rows) - r:]] = True
        rest[u, rows[len(rows) - r:]] = float("-inf")
        own = min(int(floor * (b - r)), len(rows) - r)
        if own > 0:
            keep[u, torch.topk(rest[u], own).indices] = True
            rest[u, keep[u]] = float("-inf")
        slots += b - r - max(own, 0)
    slots = min(slots, int(torch.isfinite(rest).sum()))
    if slots > 0:
        keep.view(-1)[torch.topk(rest.flatten(), slots).indices] = True
    return keep


@torch.inference_mode()
def simulate(model, ids: list[int], cfg: SimConfig, chunk: int = 16, streaming: torch.Tensor | None = None,
             retrieval: torch.Tensor | None = None) -> torch.Tensor:
    """Negative log-likelihood of ids[1:], scored in chunks as `eval ppl` does, H2O evicting after each chunk.
    The engine's `heads` roles ([layers, kv heads] bool each): streaming heads keep their first 4 and newest rows of
    their budget, retrieval heads their highest scores with no recent window."""
    mc, layers = model.config, model.model.layers
    heads, group = mc.num_kv_heads, mc.num_heads // mc.num_kv_heads
    keys = [torch.zeros(0, heads, mc.head_dim) for _ in layers]
    vals = [torch.zeros(0, heads, mc.head_dim) for _ in layers]
    alive = torch.zeros(len(layers), heads, 0, dtype=torch.bool)
    scores = torch.zeros(len(layers), heads, 0)
    nll = []
    for start in range(0, len(ids), chunk):
        tok = torch.tensor(ids[start: start + chunk])
        n, total = len(tok), start + len(tok)
        alive = torch.cat([alive, alive.new_ones(len(layers), heads, n)], -1)
        scores = torch.cat([scores, scores.new_zeros(len(layers), heads, n)], -1)
        cos, sin = model.rotary.cos_sin(torch.arange(start, total))
        causal = torch.arange(total)[None, :] <= torch.arange(start, total)[:, None]
        x = model.model.embed_tokens(tok)
        for li, layer in enumerate(layers):
            att = layer.self_attn
            q, k, v = att.project_qkv(layer.input_layernorm(x))
            if att.qk_norm:
                q, k = att.q_norm(q), att.k_norm(k)
            keys[li] = torch.cat([keys[li], apply_rope(k, cos, sin)])
            vals[li] = torch.cat([vals[li], v])
            s = torch.einsum("qhd,khd->hqk", apply_rope(q, cos, sin), keys[li].repeat_interleave(group, 1)) * att.scale
            visible = (alive[li][:, None, :] & causal).repeat_interleave(group, 0)
            probs = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
            out = torch.einsum("hqk,khd->qhd", probs, vals[li].repeat_interleave(group, 1))
            x = x + att.o_proj(out.reshape(n, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            by_kv = probs.unflatten(0, (heads, group))
            by_kv = by_kv.amax(1) if cfg.query_heads == "max" else by_kv.sum(1)
            scores[li] += (by_kv / by_kv.sum(-1, keepdim=True)).sum(1)
        logp = torch.log_softmax(model.compute_logits(model.model.norm(x)), -1)
        m = min(n, len(ids) - 1 - start)
        nll.append(-logp[torch.arange(m), torch.tensor(ids[start + 1: start + 1 + m])].double())
        if cfg.budget is not None:
            before = alive.clone()
            alive = _evict(scores, alive, cfg, total, retrieval)
            if streaming is not None:
                alive[streaming] = _sinks_and_recent(before[streaming], alive[streaming].sum(-1))
    return torch.cat(nll)


def _sinks_and_recent(alive: torch.Tensor, counts: torch.Tensor, sinks: int = 4) -> torch.Tensor:
    """alive [units, N]: each unit keeps its first `sinks` alive rows and its newest counts - sinks."""
    keep = torch.zeros_like(alive)
    for u in range(alive.shape[0]):
        rows, c = alive[u].nonzero()[:, 0], int(counts[u])
        s = min(sinks, c)
        keep[u, rows[:s]] = True
        keep[u, rows[len(rows) - (c - s):]] = True
    return keep


def _evict(scores: torch.Tensor, alive: torch.Tensor, cfg: SimConfig, seen: int,
           by_score: torch.Tensor | None = None) -> torch.Tensor:
    layers, heads = alive.shape[:2]
    budgets = cfg.layer_budgets(seen, layers)
    units = [[(li, h)] for li in range(layers) for h in range(heads)] if cfg.share == "head" else (
        [[(li, h) for h in range(heads)] for li in range(layers)] if cfg.share == "layer"
        else [[(li, h) for li in range(layers) for h in range(heads)]])
    counts = alive.sum(-1)
    for pool in units:
        want = [budgets[li] for li, _ in pool]
        if sum(int(counts[u]) for u in pool) <= sum(want) + cfg.slack * len(pool):
            continue
        idx = tuple(torch.tensor(c) for c in zip(*pool))
        recent = 0.0 if by_score is not None and len(pool) == 1 and bool(by_score[pool[0]]) else cfg.recent
        alive[idx] = select_shared(scores[idx], alive[idx], want, recent, cfg.floor)
    return alive


def main(argv: list[str] | None = None) -> None:
    from kvforge.eval.texts import load_text
    from kvforge.models.loader import load_model

    p = argparse.ArgumentParser(prog="python -m kvforge.eval.evict_sim", description=__doc__.splitlines()[0])
    p.add_argument("--text", required=True)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--baseline", type=float, help="the full-cache perplexity, if known (else scored first)")
    p.add_argument("--config", action="append", default=[], help='SimConfig fields as JSON, e.g. {"share": "layer"}')
    args = p.parse_args(argv)
    loaded = load_model(None)
    ids = loaded.tokenizer.encode(load_text(args.text))[: args.max_tokens]
    base = args.baseline or math.exp(simulate(loaded.model, ids, SimConfig(budget=None)).mean().item())
    print(f"{args.text} full cache ppl {base:.4f}", flush=True)
    for raw in args.config:
        ppl = math.exp(simulate(loaded.model, ids, SimConfig(**json_object("--config", raw, "{}"))).mean().item())
        print(f"{args.text} {raw} ppl {ppl:.4f} delta {100 * (ppl - base) / base:+.2f}%", flush=True)


if __name__ == "__main__":
    main()
