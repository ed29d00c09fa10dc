"""DeepSeek mixture of experts: shared experts plus top-k routed experts (DeepSeekMoE, arXiv:2401.06066).

Routing follows the checkpoint's generation:
- DeepSeek-V2 (softmax scores): `greedy` top-k, or `group_limited_greedy` (keep the topk_group
  groups with the highest max score, then top-k). Weights are normalised when norm_topk_prob
  (and top_k > 1), else multiplied by routed_scaling_factor.
- DeepSeek-V3 (sigmoid scores, `noaux_tc`): experts are chosen on score + e_score_correction_bias
  within the topk_group groups whose two best biased scores sum highest; weights are the unbiased
  scores, normalised when norm_topk_prob, then multiplied by routed_scaling_factor.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.errors import ModelLoadError
from kvforge.models.config import ModelConfig
from kvforge.models.layers import GatedMLP

V2_METHODS, V3_METHODS = ("greedy", "group_limited_greedy"), ("noaux_tc",)


def is_moe_layer(cfg: ModelConfig, layer_idx: int) -> bool:
    e = cfg.extra
    return bool(e.get("n_routed_experts")) and layer_idx >= (e.get("first_k_dense_replace") or 0) \
        and layer_idx % (e.get("moe_layer_freq") or 1) == 0


def _keep_top_groups(scores: torch.Tensor, n_group: int | None, topk_group: int | None,
                     group_score: Callable[[torch.Tensor], torch.Tensor], fill: float) -> torch.Tensor:
    """Mask (with `fill`) every expert outside the topk_group best groups."""
    if not n_group or n_group <= 1 or not topk_group or topk_group >= n_group:
        return scores
    grouped = scores.view(scores.shape[0], n_group, -1)
    best = group_score(grouped).topk(topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=scores.device).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], fill).view_as(scores)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e = cfg.extra
        n = int(e["n_routed_experts"])
        self.v3 = cfg.arch == "deepseek_v3"
        self.method = e.get("topk_method") or ("noaux_tc" if self.v3 else "greedy")
        scoring = e.get("scoring_func") or ("sigmoid" if self.v3 else "softmax")
        if (self.method, scoring) not in [(m, "softmax") for m in V2_METHODS] + [(m, "sigmoid") for m in V3_METHODS]:
            raise ModelLoadError(f"{cfg.arch}: topk_method {self.method!r} with scoring_func {scoring!r} is not supported; "
                                 f"supported: {V2_METHODS} with softmax (V2), {V3_METHODS} with sigmoid (V3)")
        self.top_k, self.n_group, self.topk_group = int(e["num_experts_per_tok"]), e.get("n_group"), e.get("topk_group")
        if self.n_group and n % self.n_group:
            raise ModelLoadError(f"n_routed_experts={n} is not divisible by n_group={self.n_group}")
        self.norm_topk_prob = bool(e.get("norm_topk_prob"))
        self.scaling = float(e.get("routed_scaling_factor") or 1.0)
        self.weight = nn.Parameter(torch.empty(n, cfg.hidden_size))
        if self.v3:
            self.register_buffer("e_score_correction_bias", torch.zeros(n))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights and expert ids, each [T, top_k]."""
        logits = F.linear(x.float(), self.weight.float())
        return self._noaux_tc(logits.sigmoid()) if self.v3 else self._greedy(logits.softmax(dim=-1))

    def _greedy(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.method == "group_limited_greedy":
            scores = _keep_top_groups(scores, self.n_group, self.topk_group, lambda g: g.amax(dim=-1), 0.0)
        weights, ids = scores.topk(self.top_k, dim=-1, sorted=False)
        if self.top_k > 1 and self.norm_topk_prob:
            return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20), ids
        return weights * self.scaling, ids

    def _noaux_tc(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        biased = scores + self.e_score_correction_bias.float()
        biased = _keep_top_groups(biased, self.n_group, self.topk_group,
                                  lambda g: g.topk(2, dim=-1).values.sum(dim=-1), float("-inf"))
        ids = biased.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e = cfg.extra
        inter = int(e["moe_intermediate_size"])
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(GatedMLP(cfg.hidden_size, inter) for _ in range(int(e["n_routed_experts"])))
        shared = int(e.get("n_shared_experts") or 0)
        self.shared_experts = GatedMLP(cfg.hidden_size, inter * shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = torch.zeros_like(x)
        for expert in ids.unique().tolist():
            tokens, slot = (ids == expert).nonzero(as_tuple=True)
            y = self.experts[expert](x[tokens]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(x.dtype))
        return out + self.shared_experts(x) if self.shared_experts is not None else out
