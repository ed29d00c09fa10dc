"""Linear layers on GGUF block-quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and the K-quants Q4_K, Q5_K, Q6_K),
kept as the file's block bytes (a Q8_0 LM head repacked into the kernel's lane groups, same bytes: ops/q8_lanes.py).

A weight [N, K] is held as uint8 [N, K / values * block_bytes]: each row its blocks of 32 weights (256 for the
K-quants, ops/kquants.py), exactly as in the GGUF file (an fp16 scale d, for the `_1` types an fp16 offset m, then
the codes). A weight is d * (code - offset) (+ m); for the K-quants d and m are per lane of 4 weights (sub-block
scales). `dequantize` is the exact torch reference (gguf's order of fp32 operations, so bit-identical).

`kvforge::qblock_linear(x, blocks, qtype, n, bias)`, for the rows of decode steps up to COMPILED_ROWS
(csrc/qblock_matmul.cpp, csrc/qblock_lanes.h; llama.cpp's vec_dot_q4_1_q8_1 scheme): each 32-column block of x is
rounded to int8 with its own scale (ops/int8.py's quantize_blocks, as llama.cpp's Q8_0/Q8_1 activations); 16 lanes,
each one whole weight block (32 values; Q6_K: a 16-value sub-block), get an exact integer dot product of code x
activation per block (VNNI vpdpbusd over the block's values, the code's offset undone by a -offset * sum(x) start),
times (weight block scale * activation block scale), added into an fp32 lane, group of 16 blocks after group; for
the `_1` types and Q4_K / Q5_K each lane also adds m * (activation block scale * the block's integer sum of x); the
16 lanes summed as ops/int8.py's lane_sum. Lanes past K are zeros. Each weight row is widened once per call and
dotted with every row of x. `qblock_linear_reference` repeats those integers and fp32 operations in the same
order, so the two agree bit for bit.

`kvforge::qblock_panel_linear(x, blocks, qtype, n, bias)`, for more rows: the weights dequantized per panel triple
(48 output rows) into an L2-resident fp32 buffer and multiplied by panel_matmul.cpp's tiles, fp32 activations; its
reference is F.linear on the dequantized weight (the same values, another order of additions).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from kvforge.ops import kquants, q8_lanes
from kvforge.ops.int8 import BLOCK, LANES, lane_sum, quantize_blocks

LIB = torch.library.Library("kvforge", "FRAGMENT")
COMPILED_ROWS = 32  # up to this many rows qblock_linear (integer dot products); more: qblock_panel_linear


@dataclass(frozen=True)
class BlockType:
    qtype: Q
    block_bytes: int
    offset: int  # code - offset is the signed integer the scale multiplies
    has_min: bool  # the `_1` types: an fp16 m added to every weight of the block
    codes_at: int  # byte of the block where its codes start (32-value types)
    values: int = BLOCK  # weights per block: 32, or 256 for the K-quants


BLOCK_TYPES: dict[Q, BlockType] = {
    Q.Q4_0: BlockType(Q.Q4_0, 18, 8, False, 2),
    Q.Q4_1: BlockType(Q.Q4_1, 20, 0, True, 4),
    Q.Q5_0: BlockType(Q.Q5_0, 22, 16, False, 6),
    Q.Q5_1: BlockType(Q.Q5_1, 24, 0, True, 8),
    Q.Q8_0: BlockType(Q.Q8_0, 34, 0, False, 2),
    Q.Q4_K: BlockType(Q.Q4_K, 144, 0, True, 16, kquants.SUPER),
    Q.Q5_K: BlockType(Q.Q5_K, 176, 0, True, 48, kquants.SUPER),
    Q.Q6_K: BlockType(Q.Q6_K, 210, 32, False, 0, kquants.SUPER),
}
for _t in BLOCK_TYPES.values():
    assert GGML_QUANT_SIZES[_t.qtype] == (_t.values, _t.block_bytes)


def block_type(qtype: Q | int) -> BlockType:
    from kvforge.errors import ConfigError

    try:
        return BLOCK_TYPES[Q(qtype)]
    except (KeyError, ValueError):
        raise ConfigError(f"ggml type {qtype!r} is not a block type kvforge computes in place; supported: "
                          f"{', '.join(t.name for t in BLOCK_TYPES)}") from None


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def codes(blocks: torch.Tensor, qtype: Q | int) -> torch.Tensor:
    """[n_blocks, block_bytes] uint8 -> the signed integers (code - offset) [n_blocks, values] as int32."""
    t = block_type(qtype)
    if t.values != BLOCK:
        return kquants.codes(blocks, t.qtype)
    qs = blocks[:, t.codes_at:]
    if t.qtype == Q.Q8_0:
        return qs.contiguous().view(torch.int8).to(torch.int32)
    q = torch.cat((qs & 0xF, qs >> 4), dim=-1).to(torch.int32)  # value j: low nibble of byte j, j + 16: high nibble
    if t.qtype in (Q.Q5_0, Q.Q5_1):
        qh = blocks[:, t.codes_at - 4:t.codes_at, None] >> torch.arange(8, dtype=torch.uint8)  # bit j: value j
        q = q | ((qh & 1).reshape(-1, BLOCK).to(torch.int32) << 4)
    return q - t.offset


def scales(blocks: torch.Tensor, qtype: Q | int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per block of a 32-value type: d [n_blocks] and, for the `_1` types, m [n_blocks] (fp32); K-quants: lane_scales."""
    t = block_type(qtype)
    return _f16(blocks, 0)[:, 0], (_f16(blocks, 2)[:, 0] if t.has_min else None)


def lane_scales(blocks: torch.Tensor, qtype: Q | int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per lane of 4 weights: d [n_blocks, values / 4] and m (the `_1` types and Q4_K / Q5_K) or None (fp32)."""
    t = block_type(qtype)
    if t.values != BLOCK:
        return kquants.lane_scales(blocks, t.qtype)
    d, m = scales(blocks, qtype)
    per_lane = BLOCK // 4
    return d[:, None].expand(-1, per_lane), (None if m is None else m[:, None].expand(-1, per_lane))


def natural(blocks: torch.Tensor, qtype: Q | int) -> tuple[torch.Tensor, int]:
    """A weight's blocks in the file's layout: the Q8_0 lane layout (ops/q8_lanes.py) unpacked, others as they are."""
    return (q8_lanes.unpack(blocks), int(Q.Q8_0)) if qtype == q8_lanes.Q8_0_LANES else (blocks, int(qtype))


def dequantize(blocks: torch.Tensor, qtype: Q | int) -> torch.Tensor:
    """A weight's block bytes [N, K / values * block_bytes] -> fp32 [N, K], as gguf.quants.dequantize computes it."""
    blocks, qtype = natural(blocks, qtype)
    t = block_type(qtype)
    n = blocks.shape[0]
    flat = blocks.reshape(-1, t.block_bytes)
    d, m = lane_scales(flat, qtype)
    w = d.repeat_interleave(4, dim=1) * codes(flat, qtype).float()
    return (w if m is None else w + m.repeat_interleave(4, dim=1)).reshape(n, -1)


LOSSLESS_TO_Q8_0 = (Q.Q4_0, Q.Q5_0, Q.Q8_0)  # offset-only 32-value types: their integers fit Q8_0's int8 codes


def to_q8_0(blocks: torch.Tensor, qtype: Q | int) -> torch.Tensor:
    """A weight's Q4_0 / Q5_0 / Q8_0 block bytes [N, K / 32 * block_bytes] -> the same weight as Q8_0 blocks, no loss:
    each block keeps its fp16 d and stores its integers (code - offset) as int8 codes. The `_1` types' m has no
    place in Q8_0."""
    from kvforge.errors import ConfigError

    t = block_type(qtype)
    if t.qtype not in LOSSLESS_TO_Q8_0:
        raise ConfigError(f"{t.qtype.name} blocks do not convert to Q8_0 without loss; convertible: "
                          f"{', '.join(q.name for q in LOSSLESS_TO_Q8_0)}")
    if t.qtype == Q.Q8_0:
        return blocks
    flat = blocks.reshape(-1, t.block_bytes)
    ints = codes(flat, t.qtype).to(torch.int8).view(torch.uint8)
    return torch.cat((flat[:, :2], ints), dim=1).reshape(blocks.shape[0], -1)


def rows_of(blocks: torch.Tensor, qtype: Q | int, index: torch.Tensor) -> torch.Tensor:
    """The fp32 rows `index` (any shape) of a block weight: an embedding lookup that dequantizes only those rows."""
    if qtype == q8_lanes.Q8_0_LANES:
        return dequantize(q8_lanes.unpack_rows(blocks, index.reshape(-1)), Q.Q8_0).view(*index.shape, -1)
    return dequantize(blocks[index.reshape(-1)], qtype).view(*index.shape, -1)


def lane_width(qtype: Q | int) -> int:
    """Values per lane of the few-row kernel: one 32-value block, or one 16-value Q6_K sub-block."""
    return 16 if Q(qtype) == Q.Q6_K else BLOCK


def qblock_linear_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: int, n: int,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """The operator's definition (see the module docstring): x [M, K] fp32, blocks [n, K / values * block_bytes]."""
    blocks, qtype = natural(blocks, qtype)
    t = block_type(qtype)
    rows, k = x.shape
    width = lane_width(qtype)
    padded = -(-k // (LANES * width)) * LANES * width  # whole groups of 16 lanes, zeros past K
    lanes = padded // width
    xq, dx = quantize_blocks(x)  # [M, K'] integers as fp32, [M, K' / 32]
    xq = F.pad(xq[:, :k], (0, padded - k)).double().view(rows, lanes, width)
    lane_dx = F.pad(dx[:, :k // BLOCK], (0, (padded - k) // BLOCK)).repeat_interleave(BLOCK // width, dim=1)
    flat = blocks.reshape(n * (k // t.values), t.block_bytes)
    w = F.pad(codes(flat, qtype).view(n, k), (0, padded - k)).double().view(n, lanes, width)
    dots = torch.einsum("mlj,nlj->mnl", xq, w).float()  # exact integer block dot products
    d, m = lane_scales(flat, qtype)  # per 4 weights
    lane_d = F.pad(d.reshape(n, -1)[:, ::width // 4], (0, lanes - k // width))
    scale = lane_d[None] * lane_dx[:, None]  # [M, n, lanes]
    if m is not None:
        lane_m = F.pad(m.reshape(n, -1)[:, ::width // 4], (0, lanes - k // width))[None]
        lane_sx = (lane_dx * xq.sum(-1).float())[:, None]  # activation scale * the lane's integer sum of x
    acc = torch.zeros(rows, n, LANES)
    for g in range(0, lanes, LANES):
        acc = acc + dots[:, :, g:g + LANES] * scale[:, :, g:g + LANES]
        if m is not None:
            acc = acc + lane_m[:, :, g:g + LANES] * lane_sx[:, :, g:g + LANES]
    out = lane_sum(acc)
    return out if bias is None else out + bias


def qblock_panel_linear_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: int, n: int,
                                  bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, dequantize(blocks, qtype), bias)


LIB.define("qblock_linear(Tensor x, Tensor blocks, int qtype, int n, Tensor? bias) -> Tensor")
LIB.impl("qblock_linear", qblock_linear_reference, "CompositeExplicitAutograd")
LIB.define("qblock_panel_linear(Tensor x, Tensor blocks, int qtype, int n, Tensor? bias) -> Tensor")
LIB.impl("qblock_panel_linear", qblock_panel_linear_reference, "CompositeExplicitAutograd")


def compiled_for(x: torch.Tensor) -> bool:
    """Whether the compiled kernels serve input x (fp32 on the CPU, built, the CPU has AVX-512 VNNI)."""
    from kvforge.ops.build import disabled, has_cpu_kernel

    return (x.device.type == "cpu" and x.dtype == torch.float32 and not (x.requires_grad and torch.is_grad_enabled())
            and not disabled() and has_cpu_kernel("kvforge::qblock_linear"))


def qblock_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 -> [..., N] on a block weight: integer dot products for a few rows, dequantized panel tiles
    for more (each the compiled kernel where built, else its torch reference)."""
    k, n = x.shape[-1], blocks.shape[0]
    flat = x.reshape(-1, k)
    few = flat.shape[0] <= COMPILED_ROWS
    if compiled_for(x):
        op = torch.ops.kvforge.qblock_linear if few else torch.ops.kvforge.qblock_panel_linear
        out = op.default(flat, blocks, int(qtype), n, bias)
    else:
        out = (qblock_linear_reference if few else qblock_panel_linear_reference)(flat, blocks, int(qtype), n, bias)
    return out.view(*x.shape[:-1], n)
