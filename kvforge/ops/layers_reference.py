"""Torch references of the per-layer operators (RMSNorm, in-place RoPE, SwiGLU's silu(gate) * up, GeGLU's
gelu_tanh(gate) * up): the math
the models ran before the compiled kernels (csrc/layers.cpp), and the path wherever those are not built."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.ops.panels import unpack_panels
from kvforge.rope import rotate_half


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps))


def add_rms_norm_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place); returns RMSNorm of the sum."""
    residual.add_(x)
    return rms_norm(residual, weight, eps)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x [T, heads, dim] rotated in place; cos/sin [T, dim]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x.copy_(x * cos + rotate_half(x) * sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


GATED = {"silu": silu_mul, "gelu_tanh": gelu_tanh_mul}  # the bridge's activations


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def panel_linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """csrc/panel_matmul.cpp: x @ W^T (+ bias) with W given as ops/panels.py's [P, K, 16] panels of n columns."""
    return F.linear(x, unpack_panels(panels, n), bias)


def int8_panel_linear(x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor, n: int,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """csrc/panel_matmul.cpp: panel_linear on int8 panels [P, K, 16] dequantized as float(q) * scale[column]."""
    return F.linear(x, unpack_panels(panels, n).float() * scale[:, None], bias)


def layer_bridge(attn: torch.Tensor | None, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 post: list[torch.Tensor], pre: list[torch.Tensor], heads: int, kv_heads: int, eps: float,
                 kv_write: list[torch.Tensor], family_norms: list[torch.Tensor] | None = None,
                 activation: str = "silu") -> torch.Tensor:
    """A decoder's work between two attentions (csrc/layer_bridge.cpp): with `attn` (this layer's attention
    output) and post = [o_w, o_scale, o_bias, norm_w, gate_up_w, gate_up_scale, down_w, down_scale], the rest of
    the layer; then pre = [norm_w, qkv_w, qkv_scale, qkv_bias]: the next layer's input norm, fused q/k/v projection
    and RoPE on its q and k heads, or pre = [norm_w]: the final norm. A uint8 weight is GGUF blocks (ops/qblocks.py)
    with its ggml type as a one-element int64 "scale"; a linear with another non-empty scale has int8
    weights packed by ops/int8.py, a 3-dim fp32 weight is ops/panels.py's panels; empty tensors stand for no
    scale or bias. `residual` is added to in place.
    kv_write = [k_cache, v_cache, slots] (a plain cache, [blocks, block_size, kv_heads, dim]) also stores the next
    layer's new K and V rows at their slots.
    The family's layer math: `activation` ("silu" or "gelu_tanh") of the gate times up, and family_norms =
    [post_attention, post_feedforward, q_norm, k_norm] (Gemma; empty tensors for those a family lacks, as Qwen3 has
    only the head norms): RMSNorm of o_proj's and down's outputs before their residual adds, and of each q and k
    head before RoPE. Norm weights are the multipliers themselves (Gemma's 1 + w is passed shifted)."""
    post_attn, post_mlp, q_norm, k_norm = [_given(t) for t in family_norms] if family_norms else [None] * 4
    if activation not in GATED:
        raise ValueError(f"activation must be one of {sorted(GATED)}, got {activation!r}")
    if attn is not None:
        o_w, o_s, o_b, ln2, gu_w, gu_s, down_w, down_s = post
        h = add_rms_norm_(residual, _normed(_linear(attn, o_w, o_s, o_b), post_attn, eps), ln2, eps)
        mlp = _linear(GATED[activation](_linear(h, gu_w, gu_s)), down_w, down_s)
        h = add_rms_norm_(residual, _normed(mlp, post_mlp, eps), pre[0], eps)
    else:
        h = rms_norm(residual, pre[0], eps)
    if len(pre) == 1:
        return h
    qkv = _linear(h, pre[1], pre[2], pre[3])
    heads_of = qkv.view(qkv.shape[0], -1, cos.shape[-1])
    for norm, part in ((q_norm, slice(0, heads)), (k_norm, slice(heads, heads + kv_heads))):
        if norm is not None:
            heads_of[:, part] = rms_norm(heads_of[:, part], norm, eps)
    rope_(heads_of[:, : heads + kv_heads], cos, sin)
    if kv_write:
        k_cache, v_cache, slots = kv_write
        for cache, rows in ((k_cache, heads_of[:, heads: heads + kv_heads]), (v_cache, heads_of[:, heads + kv_heads:])):
            cache.view(-1, *cache.shape[2:])[slots] = rows.to(cache.dtype)
    return qkv


def _given(t: torch.Tensor) -> torch.Tensor | None:
    return t if t.numel() else None


def _normed(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return x if weight is None else rms_norm(x, weight, eps)


def _linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    bias = bias if bias is not None and bias.numel() else None
    if weight.dtype == torch.uint8:  # GGUF blocks (ops/qblocks.py), their ggml type as the "scale"
        from kvforge.ops.qblocks import qblock_linear_reference

        return qblock_linear_reference(x, weight, int(scale), weight.shape[0], bias)
    if scale.numel():
        from kvforge.ops.int8 import int8_linear_reference

        return int8_linear_reference(x, weight, scale, bias)
    if weight.dim() == 3:
        return panel_linear(x, weight, weight.shape[0] * weight.shape[2], bias)
    return F.linear(x, weight, bias)
