"""Weight-only int8 linear layers: per-output-channel symmetric int8 weights, fp32 results.

`kvforge::int8_linear(x, qweight, scale, bias)`, for the few rows of a decode step: each 32-column block of each
row of x is rounded to int8 with its own scale (as llama.cpp's Q8_0 activations), the products are exact integer
sums (AVX-512 VNNI vpdpbusd in the compiled kernel, csrc/int8_matmul.cpp), scaled per block in fp32, then by the
weight row's scale; the torch reference below repeats the same integers and fp32 operations in the same order, so
the two agree bit for bit. A step reads a quarter of fp32's weight bytes. Larger row counts (prefill
chunks) dequantize once per call and run the BLAS on fp32 activations, where the matmul dominates.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.ops.build import disabled, has_cpu_kernel
from kvforge.ops.huge_pages import available as huge_pages_available
from kvforge.ops.huge_pages import huge_page_mapping

LIB = torch.library.Library("kvforge", "FRAGMENT")
COMPILED_ROWS = 16  # up to this many rows the operator; more: dequantize + BLAS
INT8_MAX = 127.0
BLOCK, CHUNK, LANES = 32, 64, 16  # x's columns per int8 scale; per vpdpbusd; its int32 lanes
TILE = 4  # weight rows interleaved in the packed layout


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [N, K], fp32 scale [N]) with weight ~= q * scale[:, None], |q| <= 127."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return qweight.float() * scale[:, None]


def pack(qweight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the operator's layout [ceil(N / 4), ceil(K / 64), 4, 64], zero-padded: each tile of 4 rows
    interleaved per 64-column chunk, so the kernel reads the weights as one linear stream."""
    n, k = qweight.shape
    tiles, chunks = -(-n // TILE), -(-k // CHUNK)
    padded = F.pad(qweight, (0, chunks * CHUNK - k, 0, tiles * TILE - n))
    return padded.view(tiles, TILE, chunks, CHUNK).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pack's inverse: the int8 [n, k] weight."""
    tiles, chunks = packed.shape[:2]
    return packed.transpose(1, 2).reshape(tiles * TILE, chunks * CHUNK)[:n, :k]


def in_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` in one buffer on transparent huge pages where available (ops/huge_pages.py; fewer TLB
    misses as a decode step streams every weight: ~5-15% faster on this machine), each at a 64-byte boundary."""
    if any(t.device.type == "meta" for t in tensors):  # a model built for its byte count (models/weight_store.py)
        return tensors
    sizes = [-(-t.nbytes // 64) * 64 for t in tensors]
    total = max(1, sum(sizes))
    if huge_pages_available():
        mapping, base = huge_page_mapping(total)
        flat = torch.frombuffer(mapping, dtype=torch.uint8, count=total, offset=base)
    else:
        flat = torch.empty(total, dtype=torch.uint8)
    out, offset = [], 0
    for t, size in zip(tensors, sizes):
        out.append(flat[offset:offset + t.nbytes].view(t.dtype).view(t.shape).copy_(t))
        offset += size
    return out


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (integers |q| <= 127 as fp32 [M, K'], scale [M, K' / 32]) with x ~= q * scale per 32-column
    block (llama.cpp's Q8_0 rounding of activations); K' is K rounded up to a whole 64-column chunk, zeros past K."""
    rows, k = x.shape
    width = -(-k // CHUNK) * CHUNK
    blocks = F.pad(x.float(), (0, width - k)).view(rows, width // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=2)
    limit, zero = torch.full_like(amax, INT8_MAX), torch.zeros_like(amax)  # tensor / tensor: IEEE division, as
    inv = torch.where(amax > 0, limit / amax, zero)  # the kernel (a scalar operand may become a reciprocal)
    q = torch.round(blocks * inv[:, :, None]).view(rows, width)
    return q, torch.where(amax > 0, amax / limit, zero)


def lane_sum(lanes: torch.Tensor) -> torch.Tensor:
    """[..., 16] -> [...]: halves, then quarters, eighths, the last pair (the kernel's order of fp32 additions)."""
    while lanes.shape[-1] > 1:
        half = lanes.shape[-1] // 2
        lanes = lanes[..., :half] + lanes[..., half:]
    return lanes[..., 0]


def int8_linear_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The operator's definition, on weights packed by `pack`: x rounded to int8 per 32-column block; per 64-column
    chunk, 16 lanes of exact integer sums over 4 columns each (float64 here, int32 in the kernel), each times its
    block's scale and added into an fp32 lane, chunk after chunk; the lanes summed by lane_sum, times the weight
    row's scale."""
    q, block_scale = quantize_blocks(x)
    rows, width = q.shape
    chunks = width // CHUNK
    w = unpack(packed, scale.numel(), width).double().view(-1, chunks, LANES, 4)  # zeros past K
    dots = torch.einsum("mclj,nclj->mncl", q.double().view(rows, chunks, LANES, 4), w).float()
    lane_scale = block_scale.repeat_interleave(BLOCK // 4, dim=1).view(rows, 1, chunks, LANES)
    acc = torch.zeros(rows, scale.numel(), LANES)
    for c in range(chunks):
        acc = acc + dots[:, :, c] * lane_scale[:, :, c]
    out = lane_sum(acc) * scale[None, :]
    return out if bias is None else out + bias


def dequantized_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """Many rows: fp32 activations against the dequantized weight (the BLAS)."""
    return F.linear(x, dequantize(qweight, scale), bias)


LIB.define("int8_linear(Tensor x, Tensor packed, Tensor scale, Tensor? bias) -> Tensor")
LIB.impl("int8_linear", int8_linear_reference, "CompositeExplicitAutograd")




def compiled_for(x: torch.Tensor) -> bool:
    """Whether the compiled int8_linear serves input x (fp32 on the CPU, kernels built, the CPU has AVX-512 VNNI)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and not disabled()
            and has_cpu_kernel("kvforge::int8_linear"))


def operator_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] through the operator (decode's hot path: one dispatch, few Python steps)."""
    k = x.shape[-1]
    out = torch.ops.kvforge.int8_linear.default(x.reshape(-1, k), packed, scale, bias)
    return out.view(*x.shape[:-1], out.shape[1])


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 -> [..., N] on weights packed by `pack`: the compiled operator for few rows of fp32 CPU input,
    else dequantize + BLAS."""
    if x.numel() // x.shape[-1] <= COMPILED_ROWS and compiled_for(x):
        return operator_linear(x, packed, scale, bias)
    return dequantized_linear(x, unpack(packed, scale.numel(), x.shape[-1]), scale, bias)
