"""`weights="q8_0"` / `"q4_0"`: an fp32 model's linear weights and embedding quantized at load into GGUF blocks
(models/quant_weights.py computes them in place), byte for byte as llama.cpp's reference quantizer (and
gguf.quants.quantize) writes them:
- Q8_0, per 32 weights: d = amax / 127, codes round(w / d) half away from zero, d stored as fp16;
- Q4_0, per 32 weights: d = m / -8 where m is the weight of largest magnitude (the first, on ties), codes
  min(15, trunc(w / d + 8.5)), the first 16 in the low nibbles and the last 16 in the high ones, d as fp16.
With `q4_0` the embedding and the LM head (one table when tied) are Q8_0, as llama.cpp's quantizer keeps its
output tensor at a wider type (Q6_K) than the layers'. The engine quantizes its own copy of the module tree
(tensors shared), so fp32 engines on the same loaded model are unchanged; weights whose rows are not whole blocks
stay fp32."""
from __future__ import annotations

import dataclasses

import torch
from gguf import GGMLQuantizationType as Q
from torch import nn

from kvforge.models.int8_weights import FUSED, module_copy
from kvforge.models.quant_weights import QuantBlocks, adopt_block_modules, blocks_of, dequantized_state, released

BLOCK = 32


def q8_0_blocks(weight: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] -> Q8_0 block bytes [N, K / 32 * 34], byte for byte what gguf.quants.quantize writes."""
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inv
    magnitude = scaled.abs()
    floored = magnitude.floor()
    codes = (torch.sign(scaled) * (floored + (2 * (magnitude - floored)).floor())).to(torch.int8)
    head = d.half().view(torch.uint8).reshape(n, k // BLOCK, 2)
    return torch.cat((head, codes.view(torch.uint8)), dim=-1).reshape(n, -1).contiguous()


def q4_0_blocks(weight: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] -> Q4_0 block bytes [N, K / 32 * 18], byte for byte what gguf.quants.quantize writes."""
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    extreme = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))
    d = extreme / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    codes = torch.trunc(blocks * inv + 8.5).clamp(0, 15).to(torch.uint8)
    packed = codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2:] << 4)
    head = d.half().view(torch.uint8).reshape(n, k // BLOCK, 2)
    return torch.cat((head, packed), dim=-1).reshape(n, -1).contiguous()


QUANTIZERS = {int(Q.Q8_0): q8_0_blocks, int(Q.Q4_0): q4_0_blocks}
MODES = {"q8_0": (int(Q.Q8_0), int(Q.Q8_0)), "q4_0": (int(Q.Q4_0), int(Q.Q8_0))}  # (layers, embedding and LM head)


def _blocks(w: torch.Tensor, qtype: int) -> QuantBlocks:
    return QuantBlocks(qtype, QUANTIZERS[qtype](w))


def _quantizable(w: torch.Tensor | None) -> bool:
    return (isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu"
            and w.shape[1] % BLOCK == 0 and blocks_of(w) is None)


def quantize_to_q8_0(model: nn.Module) -> int:
    return quantize_to_blocks(model, "q8_0")


@torch.no_grad()
def quantize_to_blocks(model: nn.Module, mode: str = "q8_0") -> int:
    """Give `model` (a private module tree) blocks of `mode` (MODES) for every fused projection, linear weight and
    embedding; views of fused weights become views of the fused blocks. Returns how many weights were quantized."""
    layers, tables = MODES[mode]
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    fused, count = {}, 0
    for module in model.modules():
        for name in FUSED:
            w = getattr(module, name, None)
            if _quantizable(w):
                qb = _blocks(w, layers)
                setattr(module, name, released(qb, tuple(w.shape)))
                fused[w.untyped_storage()._cdata] = (qb, w.storage_offset(), w.shape[1])
                count += 1
    done: dict[int, torch.Tensor] = {}  # tied weights: one Parameter object, quantized once
    for module in model.modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)) or not isinstance(module.weight, torch.Tensor):
            continue
        w = module.weight
        if id(w) in done:
            module.weight = done[id(w)]
            continue
        source = fused.get(w.untyped_storage()._cdata) if w.device.type == "cpu" else None
        if source is not None:
            qb, offset, k = source
            first = (w.storage_offset() - offset) // k
            part = QuantBlocks(qb.qtype, qb.data[first:first + w.shape[0]])
            module.weight = released(part, tuple(w.shape), parameter=True)
        elif _quantizable(w):
            qtype = tables if isinstance(module, nn.Embedding) or w is head else layers
            module.weight = released(_blocks(w, qtype), tuple(w.shape), parameter=True)
            count += 1
        else:
            continue
        done[id(w)] = module.weight
    adopt_block_modules(model)
    model._register_state_dict_hook(dequantized_state)
    return count


def requantized(loaded, mode: str):
    """A LoadedModel whose model is a `mode` (q8_0, q4_0) copy of loaded's fp32 one (loaded itself unchanged)."""
    model = module_copy(loaded.model)
    quantize_to_blocks(model, mode)
    return dataclasses.replace(loaded, model=model)


def q8_0_loaded(loaded):
    return requantized(loaded, "q8_0")
