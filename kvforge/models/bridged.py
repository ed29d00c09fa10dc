"""A Llama-family forward for decode and verification steps through the compiled layer bridge
(ops/layer_bridge.py): per layer, the KV write and attention stay as the model runs them (every KV format, policy
and attention path), and one operator call does everything between two attentions. Same results as the per-op
forward (same kernels)."""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from kvforge.attention import AttentionMetadata, attend
from kvforge.kv.pool import KVPool
from kvforge.models.int8_weights import INT8, is_quantized
from kvforge.models.quant_weights import blocks_of, holds_blocks
from kvforge.ops.int8 import compiled_for
from kvforge.ops.layer_bridge import BRIDGE_ROWS, WIDE_ROWS, layer_bridge, serves
from kvforge.ops.panels import PANEL, panels


@dataclass
class BridgeWeights:
    pre: list[list[torch.Tensor]]  # per layer: [input norm, qkv weight, its int8 scale, qkv bias]
    post: list[list[torch.Tensor]]  # per layer: [o weight, scale, bias, post-attention norm, gate_up w, s, down w, s]
    final: list[torch.Tensor]  # [final norm]
    int8: bool  # int8 or GGUF block weights (they need the compiled VNNI kernels, and stay at BRIDGE_ROWS rows)
    scale: float  # attention's softmax scale


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
    """The model's weights in the bridge's argument lists (built once per model), or None when its layers are not
    the plain Llama shape the bridge computes (q/k norms, soft-capping, unfused projections; int8 tiles of 4 rows
need an MLP width divisible by 4)."""
    if model not in _WEIGHTS:
        layers, cfg = model.model.layers, model.config
        plain = not cfg.qk_norm and cfg.intermediate_size % 4 == 0 and all(
            layer.self_attn.qkv_weight is not None and layer.mlp.gate_up_weight is not None
            and layer.self_attn.softcap is None for layer in layers)
        _WEIGHTS[model] = BridgeWeights(
            pre=[[layer.input_layernorm.weight, *_parts(layer.self_attn.qkv_weight),
                  _bias(layer.self_attn.qkv_bias, layer.self_attn.qkv_weight)] for layer in layers],
            post=[[*_parts(layer.self_attn.o_proj.weight), _bias(layer.self_attn.o_proj.bias, layer.self_attn.o_proj.weight),
                   layer.post_attention_layernorm.weight, *_parts(layer.mlp.gate_up_weight),
                   *_parts(layer.mlp.down_proj.weight)] for layer in layers],
            final=[model.model.norm.weight], int8=is_quantized(model) or holds_blocks(model),
            scale=layers[0].self_attn.scale) if plain else None
    return _WEIGHTS[model]


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
    """The model's bridge weights when this step (embeddings x) can run through the bridge, else None."""
    if not serves(x):
        return None
    weights = _weights(model) if x.shape[0] <= BRIDGE_ROWS else _wide_weights(model)
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


def forward_bridged(model: nn.Module, weights: BridgeWeights, x: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, meta: AttentionMetadata, kv: KVPool,
                    layers: Sequence[int]) -> torch.Tensor:
    """Final-normed hidden states of `layers` (ascending) over embeddings x, which become the residual stream. The
    bridge stores a layer's new K and V itself when the layer's cache is a plain one; other formats write here."""
    cfg, t = model.config, x.shape[0]
    heads, kv_heads, eps = cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps
    writes = [_plain_write(kv, meta, i) for i in layers]
    qkv = layer_bridge(None, x, cos, sin, [], weights.pre[layers[0]], heads, kv_heads, eps, writes[0])
    for n, i in enumerate(layers):
        q, k, v = qkv.view(t, heads + 2 * kv_heads, -1).split_with_sizes([heads, kv_heads, kv_heads], dim=1)
        if not writes[n]:
            kv.write(i, meta, k, v)
        out = attend(q, kv.layers[i], meta.for_layer(i), weights.scale)
        last = n + 1 == len(layers)
        pre, write = (weights.final, []) if last else (weights.pre[layers[n + 1]], writes[n + 1])
        qkv = layer_bridge(out.reshape(t, -1), x, cos, sin, weights.post[i], pre, heads, kv_heads, eps, write)
    return qkv


def _plain_write(kv: KVPool, meta: AttentionMetadata, layer: int) -> list[torch.Tensor]:
    """[k_cache, v_cache, slots] for the bridge to store the layer's new rows itself (a plain fp32/fp16/bf16 cache),
    else []: the format's own write runs (LayerKV.plain_rows says which)."""
    rows = kv.layers[layer].plain_rows()
    return [] if rows is None else [*rows, meta.for_layer(layer).slot_mapping]
