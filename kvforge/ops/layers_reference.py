"""Torch references of the per-layer operators (RMSNorm, in-place RoPE, SwiGLU's silu(gate) * up): the math
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
                 kv_write: list[torch.Tensor]) -> torch.Tensor:
    """A decoder's work between two attentions (csrc/layer_bridge.cpp): with `attn` (this layer's attention
    output) and post = [o_w, o_scale, o_bias, norm_w, gate_up_w, gate_up_scale, down_w, down_scale], the rest of
    the layer; then pre = [norm_w, qkv_w, qkv_scale, qkv_bias]: the next layer's input norm, fused q/k/v projection
    and RoPE on its q and k heads, or pre = [norm_w]: the final norm. A uint8 weight is GGUF blocks (ops/qblocks.py)
    with its ggml type as a one-element int64 "scale"; a linear with another non-empty scale has int8
    weights packed by ops/int8.py, a 3-dim fp32 weight is ops/panels.py's panels; empty tensors stand for no
    scale or bias. `residual` is added to in place.
    kv_write = [k_cache, v_cache, slots] (a plain cache, [blocks, block_size, kv_heads, dim]) also stores the next
    layer's new K and V rows at their slots."""
    if attn is not None:
        o_w, o_s, o_b, ln2, gu_w, gu_s, down_w, down_s = post
        h = add_rms_norm_(residual, _linear(attn, o_w, o_s, o_b), ln2, eps)
        h = add_rms_norm_(residual, _linear(silu_mul(_linear(h, gu_w, gu_s)), down_w, down_s), pre[0], eps)
    else:
        h = rms_norm(residual, pre[0], eps)
    if len(pre) == 1:
        return h
    qkv = _linear(h, pre[1], pre[2], pre[3])
    heads_of = qkv.view(qkv.shape[0], -1, cos.shape[-1])
    rope_(heads_of[:, : heads + kv_heads], cos, sin)
    if kv_write:
        k_cache, v_cache, slots = kv_write
        for cache, rows in ((k_cache, heads_of[:, heads: heads + kv_heads]), (v_cache, heads_of[:, heads + kv_heads:])):
            cache.view(-1, *cache.shape[2:])[slots] = rows.to(cache.dtype)
    return qkv


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
