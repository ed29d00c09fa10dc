"""A decoder forward for decode and verification steps through the compiled layer bridge (ops/layer_bridge.py):
per layer, the KV write and attention stay as the model runs them (every KV format, policy, soft-cap and attention
path), and one operator call does everything between two attentions. Same results as the per-op forward (same
kernels). A family's layer math reaches the bridge from its decoder layers' `bridge_norms()` (which norm weights
sit where) and its MLP's `activation`: Llama/Qwen2/Mistral, Qwen3 (q/k head norms), Gemma 2/3 (norms of the
attention and MLP outputs, (1 + w) weights passed shifted, GELU-tanh, q/k head norms in Gemma 3)."""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import nn

from kvforge.attention import AttentionMetadata, attend
from kvforge.kv.pool import KVPool
from kvforge.models.int8_weights import INT8, is_quantized
from kvforge.models.quant_weights import blocks_of, holds_blocks
from kvforge.ops.int8 import compiled_for
from kvforge.ops.layer_bridge import BRIDGE_ROWS, WIDE_ROWS, layer_bridge, serves
from kvforge.ops.layers_reference import GATED
from kvforge.ops.panels import PANEL, panels
from kvforge.ops.qblocks import COMPILED_ROWS


class LayerNorms(NamedTuple):
    """A decoder layer's RMSNorm multipliers as the bridge places them (None: the family has no such norm)."""
    input: torch.Tensor  # before attention
    pre_mlp: torch.Tensor  # of the residual stream, before the MLP
    post_attn: torch.Tensor | None  # of o_proj's output, before its residual add (Gemma)
    post_mlp: torch.Tensor | None  # of down's output, before its residual add (Gemma)
    q: torch.Tensor | None  # of each q head, before RoPE (Qwen3, Gemma 3)
    k: torch.Tensor | None


@dataclass
class BridgeWeights:
    pre: list[list[torch.Tensor]]  # per layer: [input norm, qkv weight, its int8 scale, qkv bias]
    post: list[list[torch.Tensor]]  # per layer: [o weight, scale, bias, pre-MLP norm, gate_up w, s, down w, s]
    final: list[torch.Tensor]  # [final norm]
    int8: bool  # int8 or GGUF block weights (they need the compiled VNNI kernels; int8 stays at BRIDGE_ROWS rows)
    scale: float  # attention's softmax scale
    norms: list[list[torch.Tensor]] | None = None  # per layer: [post_attn, post_mlp, q, k] (empty: none), None: Llama's
    activation: str = "silu"  # of the gate, times up
    softcaps: list[float | None] | None = None  # per layer: attention soft-cap (Gemma 2)
    blocks: bool = False  # every projection in GGUF blocks: the bridge serves up to COMPILED_ROWS rows, as per-op
    empty: list[torch.Tensor] | None = None  # [no norm, no norm]: family_norms' halves for the first and last calls

    def family_norms(self, layer: int | None, next_layer: int | None) -> list[torch.Tensor] | None:
        """The bridge's family_norms for the call after `layer`'s attention (None: the first call) that prepares
        `next_layer` (None: the final norm)."""
        if self.norms is None:
            return None
        return [*(self.empty if layer is None else self.norms[layer][:2]),
                *(self.empty if next_layer is None else self.norms[next_layer][2:])]


_WEIGHTS: weakref.WeakKeyDictionary[nn.Module, BridgeWeights | None] = weakref.WeakKeyDictionary()
_WIDE: weakref.WeakKeyDictionary[nn.Module, BridgeWeights | None] = weakref.WeakKeyDictionary()


def _parts(weight: torch.Tensor) -> list[torch.Tensor]:
    """[weight, scale] in the operator's form: the int8 packed weight and its scales, GGUF blocks and their ggml type
    (models/quant_weights.py), or the fp32 weight, no scale."""
    blocks = blocks_of(weight)
    if blocks is not None:
        return [blocks.data, torch.tensor([blocks.qtype], device=blocks.data.device)]
    q = getattr(weight, INT8, None)
    return [weight, _none(weight)] if q is None else [q[0], q[1]]


def _bias(bias: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
    return _none(weight) if bias is None else bias


def _none(like: torch.Tensor) -> torch.Tensor:
    """The operator's empty tensor for no scale or bias, on the weights' device (a tensor made at import could land
    on the meta device the loader builds models on, and send every call to the torch reference; an int8 weight's
    released fp32 original is on the meta device, its int8 form is not)."""
    blocks = blocks_of(like)
    return torch.empty(0, device=blocks.data.device if blocks is not None else getattr(like, INT8, (like,))[0].device)


def _weights(model: nn.Module) -> BridgeWeights | None:
    """The model's weights in the bridge's argument lists (built once per model), or None when its layers do not
    take the bridge (unfused projections, layer math it lacks: no `bridge_norms`, another activation, per-layer
    scales; int8 tiles of 4 rows need an MLP width divisible by 4)."""
    if model not in _WEIGHTS:
        layers, cfg = model.model.layers, model.config
        activations = {getattr(layer.mlp, "activation", None) for layer in layers}
        fits = cfg.intermediate_size % 4 == 0 and len(activations) == 1 and activations <= set(GATED) and all(
            layer.self_attn.qkv_weight is not None and layer.mlp.gate_up_weight is not None
            and hasattr(layer, "bridge_norms") for layer in layers)
        fits = fits and len({layer.self_attn.scale for layer in layers}) == 1
        _WEIGHTS[model] = _gathered(model, activations.pop()) if fits else None
    return _WEIGHTS[model]


def _gathered(model: nn.Module, activation: str) -> BridgeWeights:
    layers = model.model.layers
    norms = [layer.bridge_norms() for layer in layers]
    empty = _none(layers[0].self_attn.qkv_weight)
    extra = [[empty if t is None else t for t in (n.post_attn, n.post_mlp, n.q, n.k)] for n in norms]
    return BridgeWeights(
        pre=[[n.input, *_parts(layer.self_attn.qkv_weight), _bias(layer.self_attn.qkv_bias, layer.self_attn.qkv_weight)]
             for n, layer in zip(norms, layers)],
        post=[[*_parts(layer.self_attn.o_proj.weight), _bias(layer.self_attn.o_proj.bias, layer.self_attn.o_proj.weight),
               n.pre_mlp, *_parts(layer.mlp.gate_up_weight), *_parts(layer.mlp.down_proj.weight)]
              for n, layer in zip(norms, layers)],
        final=[model.model.norm.multiplier], int8=is_quantized(model) or holds_blocks(model), scale=layers[0].self_attn.scale,
        blocks=not is_quantized(model) and all(blocks_of(w) is not None for layer in layers for w in (
            layer.self_attn.qkv_weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up_weight,
            layer.mlp.down_proj.weight)),
        norms=extra if any(t.numel() for row in extra for t in row) else None, activation=activation,
        softcaps=[layer.self_attn.softcap for layer in layers], empty=[empty, empty])


def _wide_weights(model: nn.Module) -> BridgeWeights | None:
    """_weights with every fp32 projection as its panel copy (ops/panels.py, the one the per-op path uses at these
    row counts), for steps of more than BRIDGE_ROWS rows; None for int8 weights or widths not in whole panels."""
    if model not in _WIDE:
        base = _weights(model)
        linears = [] if base is None else [p[1] for p in base.pre] + [w for p in base.post for w in (p[0], p[4], p[6])]
        ok = base is not None and not base.int8 and all(w.shape[0] % PANEL == 0 for w in linears)
        _WIDE[model] = replace(
            base, pre=[[n, panels(w), s, b] for n, w, s, b in base.pre],
            post=[[panels(o), os, ob, ln, panels(gu), gus, panels(d), ds]
                  for o, os, ob, ln, gu, gus, d, ds in base.post]) if ok else None
    return _WIDE[model]


def bridged(model: nn.Module, x: torch.Tensor) -> BridgeWeights | None:
    """The model's bridge weights when this step (embeddings x) can run through the bridge, else None. GGUF block
    weights take the few-row integer kernels up to COMPILED_ROWS rows, as the per-op path does (same floats)."""
    if not serves(x):
        return None
    rows = x.shape[0]
    weights = _weights(model) if rows <= BRIDGE_ROWS else _wide_weights(model)
    if weights is None and rows <= COMPILED_ROWS and _weights(model) is not None and _weights(model).blocks:
        weights = _weights(model)
    return None if weights is None or (weights.int8 and not compiled_for(x)) else weights


def bridged_rows(model: nn.Module, rows: int) -> BridgeWeights | None:
    """The bridge weights a step of `rows` rows of this model would run on (built now if new), None where it would
    not run through the bridge (another architecture, the per-op path forced, the kernels not built)."""
    if not getattr(model, "use_bridge", False):
        return None
    return bridged(model, torch.zeros(rows, model.config.hidden_size, device=next(model.parameters()).device))


def prepare_bridge(model: nn.Module) -> None:
    """Build both of the model's bridge weight sets now, when the engine is built (after models/weight_store.py
    made the panels they take), where the bridge serves it."""
    if bridged_rows(model, WIDE_ROWS) is not None:
        panels(model.lm_head.weight)


def forward_bridged(model: nn.Module, weights: BridgeWeights, x: torch.Tensor,
                    rope: Sequence[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata, kv: KVPool,
                    layers: Sequence[int]) -> torch.Tensor:
    """Final-normed hidden states of `layers` (ascending) over embeddings x, which become the residual stream;
    rope[i]: layer i's (cos, sin). The bridge stores a layer's new K and V itself when the layer's cache is a plain
    one; other formats write here."""
    cfg, t = model.config, x.shape[0]
    heads, kv_heads, eps = cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps
    writes = [_plain_write(kv, meta, i) for i in layers]
    softcaps = weights.softcaps or [None] * len(rope)
    qkv = layer_bridge(None, x, *rope[layers[0]], [], weights.pre[layers[0]], heads, kv_heads, eps, writes[0],
                       weights.family_norms(None, layers[0]), weights.activation)
    for n, i in enumerate(layers):
        q, k, v = qkv.view(t, heads + 2 * kv_heads, -1).split_with_sizes([heads, kv_heads, kv_heads], dim=1)
        if not writes[n]:
            kv.write(i, meta, k, v)
        out = attend(q, kv.layers[i], meta.for_layer(i), weights.scale, softcaps[i])
        nxt = None if n + 1 == len(layers) else layers[n + 1]
        pre, write = (weights.final, []) if nxt is None else (weights.pre[nxt], writes[n + 1])
        qkv = layer_bridge(out.reshape(t, -1), x, *rope[i if nxt is None else nxt], weights.post[i], pre, heads,
                           kv_heads, eps, write, weights.family_norms(i, nxt), weights.activation)
    return qkv


def _plain_write(kv: KVPool, meta: AttentionMetadata, layer: int) -> list[torch.Tensor]:
    """[k_cache, v_cache, slots] for the bridge to store the layer's new rows itself (a plain fp32/fp16/bf16 cache),
    else []: the format's own write runs (LayerKV.plain_rows says which)."""
    rows = kv.layers[layer].plain_rows()
    return [] if rows is None else [*rows, meta.for_layer(layer).slot_mapping]
