"""GGUF block-quantized weights kept as stored (`weights="auto"` on a GGUF file): each Q4_0/Q4_1/Q5_0/Q5_1/Q8_0
linear weight and embedding is held as its file's block bytes (ops/qblocks.py), no fp32 copy.

As with int8 (models/int8_weights.py), the weight tensor the model holds is released to the meta device (shapes,
ties and state dicts keep working; `state_dict` gives the dequantized values) and carries its blocks as an
attribute, so the model code is the same: `linear` (models/int8_weights.py) computes from the blocks
(ops/qblocks.qblock_linear: integer dot products for a few rows, dequantized panel tiles for more), an embedding
dequantizes the rows it looks up, and the tied LM head runs the embedding's blocks (Q8_0 in the embedded model).
Fused projections (q/k/v, gate/up) concatenate their parts' blocks when all share one block type, each part's
blocks a view into the fused ones; parts of different types that all convert to Q8_0 without loss (Q4_0, Q5_0,
Q8_0, e.g. Gemma 3's Q5_0 q/k beside a Q8_0 v) are converted and fused as Q8_0 blocks; otherwise the parts are
dequantized and fused in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as Q
from torch import nn

from kvforge.ops import q8_lanes
from kvforge.ops.build import disabled, has_cpu_kernel
from kvforge.ops.qblocks import BLOCK_TYPES, LOSSLESS_TO_Q8_0, dequantize, qblock_linear, rows_of, to_q8_0

QBLOCKS = "_kvforge_qblocks"  # attribute of a released weight tensor: its QuantBlocks
RELEASED = "_kvforge_released"  # as models/int8_weights.py: the tensor's values live in another form


@dataclass(frozen=True)
class QuantBlocks:
    qtype: int  # ggml type id (ops/qblocks.py BLOCK_TYPES)
    data: torch.Tensor  # uint8 [N, K / 32 * block_bytes], rows of the weight in the file's block layout

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.data, self.qtype)


def keeps_blocks(qtype: int, shape: tuple[int, ...]) -> bool:
    """Whether a GGUF tensor of this type and shape stays in its blocks: a 2-D tensor of a block type computed
    in place."""
    return len(shape) == 2 and qtype in {int(t) for t in BLOCK_TYPES}


def released(blocks: QuantBlocks, shape: tuple[int, ...], parameter: bool = False) -> torch.Tensor:
    """A meta tensor of `shape` whose values live in `blocks`."""
    out = torch.empty(shape, dtype=torch.float32, device="meta")
    out = nn.Parameter(out, requires_grad=False) if parameter else out
    setattr(out, RELEASED, True)
    setattr(out, QBLOCKS, blocks)
    return out


def blocks_of(weight: torch.Tensor | None) -> QuantBlocks | None:
    return None if weight is None else getattr(weight, QBLOCKS, None)


def block_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    qb = getattr(weight, QBLOCKS)
    return qblock_linear(x, qb.data, qb.qtype, bias)


class QBlockLinear(nn.Linear):
    """An nn.Linear whose weight lives in GGUF blocks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block_linear(x, self.weight, self.bias)


class QBlockEmbedding(nn.Embedding):
    """An nn.Embedding whose table lives in GGUF blocks: a lookup dequantizes only the rows it reads."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        qb = getattr(self.weight, QBLOCKS)
        return rows_of(qb.data, qb.qtype, input_ids)


def attach_blocks(model: nn.Module, blocks: dict[str, QuantBlocks]) -> None:
    """After load_state_dict(assign=True) of meta placeholders: each named parameter gets its blocks."""
    for name, qb in blocks.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        setattr(module, attr, released(qb, tuple(getattr(module, attr).shape), parameter=True))


def adopt_block_modules(model: nn.Module) -> None:
    """Every Linear and Embedding whose weight lives in blocks (tied ones too) computes from them."""
    for module in model.modules():
        if blocks_of(getattr(module, "weight", None)) is None:
            continue
        if type(module) is nn.Embedding:
            module.__class__ = QBlockEmbedding
        elif type(module) is nn.Linear:
            module.__class__ = QBlockLinear


def holds_blocks(model: nn.Module) -> bool:
    return any(isinstance(m, (QBlockLinear, QBlockEmbedding)) for m in model.modules())


@torch.no_grad()
def fuse_blocks(linears: tuple[nn.Linear, ...]) -> torch.Tensor | None:
    """The fused weight of `linears` when any lives in blocks: their blocks concatenated (each part's weight
    becomes a view of them) when all share one block type, or as Q8_0 blocks when their types differ but all
    convert to Q8_0 without loss (Q4_0, Q5_0, Q8_0: ops/qblocks.to_q8_0), else None after dequantizing every part
    to fp32 (the caller then fuses them as fp32)."""
    parts = [blocks_of(lin.weight) for lin in linears]
    if all(p is None for p in parts):
        return None
    if all(p is not None for p in parts) and any(p.qtype != parts[0].qtype for p in parts) and all(
            p.qtype in LOSSLESS_TO_Q8_0 for p in parts):
        parts = [QuantBlocks(int(Q.Q8_0), to_q8_0(p.data, p.qtype)) for p in parts]
    if all(p is not None and p.qtype == parts[0].qtype for p in parts):
        data = torch.cat([p.data for p in parts])
        fused = released(QuantBlocks(parts[0].qtype, data), (data.shape[0], linears[0].weight.shape[1]))
        first = 0
        for lin, p in zip(linears, parts):
            rows = p.data.shape[0]
            lin.weight = released(QuantBlocks(p.qtype, data[first:first + rows]), tuple(lin.weight.shape), True)
            first += rows
        return fused
    for lin, p in zip(linears, parts):
        if p is not None:
            lin.weight = nn.Parameter(p.dequantized(), requires_grad=False)
            lin.__class__ = nn.Linear
    return None


def block_weights(model: nn.Module) -> list[torch.Tensor]:
    """Every distinct tensor of `model` that carries blocks (parameters and fused buffers)."""
    found = {}
    for module in model.modules():
        for t in (*module._parameters.values(), *module._buffers.values()):
            if blocks_of(t) is not None:
                found[id(t)] = t
    return list(found.values())


def block_data(model: nn.Module) -> list[torch.Tensor]:
    """The block bytes of every weight held in blocks (fused ones and their parts' views)."""
    return [blocks_of(t).data for t in block_weights(model)]


def dequantized_state(module: nn.Module, state: dict, prefix: str, _metadata) -> None:
    """state_dict hook: each weight held in blocks as the fp32 values it computes with."""
    for name, p in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
        qb = blocks_of(p)
        if qb is not None and name in state:
            state[name] = qb.dequantized()


@torch.no_grad()
def repack_head(model: nn.Module) -> None:
    """A Q8_0 LM head (tied to the embedding or not) of a shape the lane layout takes, repacked into it
    (ops/q8_lanes.py: same bytes; the few-row kernel reads it without widening, and a K = 512 G + 128 row's tail
    costs a quarter), where the compiled kernels serve it. The embedding lookup and state dicts read it too."""
    head = getattr(model, "lm_head", None)
    qb = blocks_of(getattr(head, "weight", None))
    if qb is None or not q8_lanes.packs(qb.qtype, tuple(qb.data.shape)) or qb.data.device.type != "cpu":
        return
    if disabled() or not has_cpu_kernel("kvforge::qblock_linear"):
        return
    setattr(head.weight, QBLOCKS, QuantBlocks(q8_lanes.Q8_0_LANES, q8_lanes.pack(qb.data)))
