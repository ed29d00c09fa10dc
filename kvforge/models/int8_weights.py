"""Weight-only int8 models (`EngineConfig(weights="int8")`): every linear layer's weight, the fused q/k/v and
gate/up weights and the LM head get an int8 copy with one scale per output channel (kvforge/ops/int8.py); the
embedding lookup stays fp32. The engine quantizes its own copy of the module tree (tensors shared, nothing
copied), so an fp32 engine over the same loaded model is unchanged. Prefill chunks multiply by a dequantized
fp32 copy of each weight, made on first use (the same values; memory: one more fp32 copy, plus oneDNN's).

A quantized weight carries its int8 form as an attribute of the weight tensor the model passes to `linear`,
so the model code is the same for both: `linear` below dispatches on it.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from kvforge.ops import layers as ops_layers
from kvforge.ops.int8 import (
    COMPILED_ROWS,
    compiled_for,
    dequantize,
    in_huge_pages,
    operator_linear,
    pack,
    quantize_per_channel,
    unpack,
)

INT8 = "_kvforge_int8"  # attribute of a weight tensor: its (int8 weight packed for the operator, per-row scale)
DEQUANTIZED = "_kvforge_int8_dense"  # and its dequantized fp32 copy, for prefill chunks
FUSED = ("qkv_weight", "gate_up_weight")  # fused projections the models call through `linear` (llama.py, layers.py)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """ops.layers.linear, or for a quantized `weight` the compiled int8 operator (decode's few rows) or, for more
    rows (prefill chunks) and where no kernel is built, ops.layers.linear on the dequantized weight, made once
    and kept (oneDNN packs it once)."""
    q = getattr(weight, INT8, None)
    if q is None:
        return ops_layers.linear(x, weight, bias)
    if x.numel() // x.shape[-1] <= COMPILED_ROWS and compiled_for(x):
        return operator_linear(x, q[0], q[1], bias)
    dense = getattr(weight, DEQUANTIZED, None)
    if dense is None:
        dense = dequantize(unpack(q[0], *weight.shape), q[1])
        setattr(weight, DEQUANTIZED, dense)
    return ops_layers.linear(x, dense, bias)


class Int8Linear(nn.Linear):
    """An nn.Linear whose weight has an int8 form (its fp32 weight stays for state dicts and readers)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) for m in model.modules())


def _marked(weight: torch.Tensor, parameter: bool = False) -> torch.Tensor:
    """A new tensor object over the same storage, carrying the int8 form (the original stays unmarked)."""
    out = nn.Parameter(weight.detach(), requires_grad=False) if parameter else weight.detach()
    q, scale = quantize_per_channel(weight)
    setattr(out, INT8, (pack(q), scale))
    return out


@torch.no_grad()
def quantize_model(model: nn.Module) -> int:
    """Give every linear layer of `model` (a private module tree) int8 weights; returns how many weights. The packed
    int8 weights share one buffer in transparent huge pages (ops/int8.py's in_huge_pages)."""
    fused_storages, marked = set(), []
    for module in model.modules():
        for name in FUSED:
            w = getattr(module, name, None)
            if isinstance(w, torch.Tensor):
                marked.append(_marked(w))
                setattr(module, name, marked[-1])
                fused_storages.add(w.untyped_storage().data_ptr())
    for module in list(model.modules()):
        if not isinstance(module, nn.Linear) or isinstance(module, Int8Linear):
            continue
        w = module.weight
        if w.untyped_storage().data_ptr() in fused_storages:  # a view of a fused weight: never called alone
            continue
        module.__class__ = Int8Linear
        module.weight = _marked(w, parameter=True)
        marked.append(module.weight)
    packed = in_huge_pages([getattr(w, INT8)[0] for w in marked])
    for w, p in zip(marked, packed):
        setattr(w, INT8, (p, getattr(w, INT8)[1]))
    return len(marked)


def module_copy(model: nn.Module) -> nn.Module:
    """A copy of the module tree that shares every tensor (parameters, buffers, tensor attributes)."""
    memo = {}
    for module in model.modules():
        for t in [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]:
            if isinstance(t, torch.Tensor):
                memo[id(t)] = t
    return copy.deepcopy(model, memo)


def int8_loaded(loaded):
    """A LoadedModel whose model is an int8-weight copy of loaded's (loaded itself unchanged)."""
    if is_quantized(loaded.model):
        return loaded
    model = module_copy(loaded.model)
    quantize_model(model)
    return dataclasses.replace(loaded, model=model)
