"""Weight-only int8 models (`EngineConfig(weights="int8")`): every linear layer's weight, the fused q/k/v and
gate/up weights and the LM head get an int8 form with one scale per output channel (kvforge/ops/int8.py); the
embedding lookup stays fp32. The engine quantizes its own copy of the module tree (tensors shared), so an fp32
engine over the same loaded model is unchanged; the copy's quantized weights and the views of fused ones release
their fp32 originals (on the meta device: shapes stay, values live in the int8 form; `state_dict` gives the
dequantized values). Steps of more rows than the operator takes (prefill, large batches) run
`kvforge::int8_panel_linear` on the same int8 values laid out in panels (ops/panels.py), made when the engine is
built (models/weight_store.py): each panel triple is dequantized into L2 and multiplied as panel_linear would the
dequantized weight, bit for bit (a per-call dequantization of the whole weight measured 2.5-6x slower at 17-64
rows; a kept fp32 copy costs 4 bytes per weight).

A quantized weight carries its int8 form as an attribute of the weight tensor the model passes to `linear`,
so the model code is the same for both: `linear` below dispatches on it.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from kvforge.models.quant_weights import QBLOCKS, block_linear
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
from kvforge.ops.panels import pack_panels, unpack_panels

INT8 = "_kvforge_int8"  # attribute of a weight tensor: its (int8 weight packed for the operator, per-row scale)
PANELS = "_kvforge_int8_panels"  # and the same int8 values as panels [P, K, 16], for steps of more rows
RELEASED = "_kvforge_released"  # True on a tensor whose fp32 values were released (they live in an int8 form)
SOURCE = "_kvforge_int8_source"  # a released view of a fused weight: (the fused quantized weight, its first row)
FUSED = ("qkv_weight", "gate_up_weight")  # fused projections the models call through `linear` (llama.py, layers.py)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """ops.layers.linear, for a weight held in GGUF blocks models/quant_weights.py's block_linear, or for an int8
    `weight` the compiled int8 operator (decode's few rows) or, for more
    rows and where no kernel is built, int8_panel_linear (fp32 activations times the dequantized weight)."""
    q = getattr(weight, INT8, None)
    if q is None:
        if getattr(weight, QBLOCKS, None) is not None:
            return block_linear(x, weight, bias)
        return ops_layers.linear(x, weight, bias)
    if x.numel() // x.shape[-1] <= COMPILED_ROWS and compiled_for(x):
        return operator_linear(x, q[0], q[1], bias)
    out = ops_layers.int8_panel_linear(x.reshape(-1, x.shape[-1]), int8_panels(weight), q[1], bias)
    return out.view(*x.shape[:-1], out.shape[1])


def int8_panels(weight: torch.Tensor) -> torch.Tensor:
    """A quantized weight's int8 values as panels [P, K, 16] (made now if new)."""
    panels = getattr(weight, PANELS, None)
    if panels is None:
        with torch.no_grad():
            panels = pack_panels(unpack(getattr(weight, INT8)[0], *weight.shape))
        setattr(weight, PANELS, panels)
    return panels


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The fp32 values a released weight computes with: its dequantized rows (a copy)."""
    fused, first = getattr(weight, SOURCE, (weight, 0))
    rows = slice(first, first + weight.shape[0])
    return dequantize(unpack_panels(int8_panels(fused), fused.shape[0])[rows], getattr(fused, INT8)[1][rows])


class Int8Linear(nn.Linear):
    """An nn.Linear whose weight has an int8 form (its fp32 original released, models/weight_store.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) for m in model.modules())


def _marked(weight: torch.Tensor, parameter: bool = False) -> torch.Tensor:
    """A new tensor of weight's shape whose values live in the int8 form it carries, its fp32 storage released (the
    original stays as it was, for whoever else holds it)."""
    out = _released(weight, parameter)
    q, scale = quantize_per_channel(weight)
    setattr(out, INT8, (pack(q), scale))
    return out


def _released(weight: torch.Tensor, parameter: bool) -> torch.Tensor:
    out = torch.empty(weight.shape, dtype=weight.dtype, device="meta")
    out = nn.Parameter(out, requires_grad=False) if parameter else out
    setattr(out, RELEASED, True)
    return out


def quantized_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights of `model` that carry an int8 form (fused buffers and Int8Linear weights)."""
    found = {id(t): t for module in model.modules()
             for t in [*(getattr(module, n, None) for n in FUSED), getattr(module, "weight", None)]
             if isinstance(t, torch.Tensor) and getattr(t, INT8, None) is not None}
    return list(found.values())


@torch.no_grad()
def quantize_model(model: nn.Module) -> int:
    """Give every linear layer of `model` (a private module tree) int8 weights and release their fp32 originals;
    returns how many weights. The packed int8 weights share one buffer in transparent huge pages (ops/int8.py's
    in_huge_pages)."""
    fused, marked, views = {}, [], []
    for module in model.modules():
        for name in FUSED:
            w = getattr(module, name, None)
            if isinstance(w, torch.Tensor):
                marked.append(_marked(w))
                setattr(module, name, marked[-1])
                fused[w.untyped_storage()._cdata] = (marked[-1], w.storage_offset())
    for module in list(model.modules()):
        if not isinstance(module, nn.Linear) or isinstance(module, Int8Linear):
            continue
        w = module.weight
        source = fused.get(w.untyped_storage()._cdata)
        if source is not None:  # a view of a fused weight: never called alone
            views.append((module, source[0], (w.storage_offset() - source[1]) // w.shape[1]))
            continue
        module.__class__ = Int8Linear
        module.weight = _marked(w, parameter=True)
        marked.append(module.weight)
    packed = in_huge_pages([getattr(w, INT8)[0] for w in marked])
    for w, p in zip(marked, packed):
        setattr(w, INT8, (p, getattr(w, INT8)[1]))
    for module, source, first in views:
        module.weight = _released(module.weight, parameter=True)
        setattr(module.weight, SOURCE, (source, first))
    model._register_state_dict_hook(_dequantized_state)
    return len(marked)


def _dequantized_state(module: nn.Module, state: dict, prefix: str, _metadata) -> None:
    """state_dict of a quantized tree: each released weight as the dequantized values it computes with."""
    for name, p in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
        if getattr(p, RELEASED, False) and name in state:
            state[name] = dequantized(p)


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
