"""Q8_0 weights repacked into the few-row kernel's lane groups (ggml type id Q8_0_LANES, kvforge's own), same bytes.

qblock_matmul.cpp reads Q8_0 rows as lane groups of 16 blocks (csrc/qblock_lanes.h), widening each group with ~50
shuffles; a Q8_0 LM head of a large vocabulary spends most of a one-row decode step there. Repacked once at engine
build (models/weight_store.py), a group is 16 fp16 scales then 8 steps of 64 bytes (step s, lane l: codes 4s..4s+3
of block l, + 128 as unsigned bytes), read by plain loads. Rows are packed in fours: each row's whole groups, then
one group holding the last 4 blocks of all 4 rows (lane l: row l / 4, block l % 4), so a row of K = 512 G + 128
(Gemma 3's 640) spends 2 integer dot products on its tail, not 8. Every integer and fp32 operation is the Q8_0
kernel's, so both give the same floats; `unpack` restores the file's blocks exactly.
"""
from __future__ import annotations

import torch

Q8_0_LANES = 1008  # not a ggml type: Q8_0 in lane groups
ROWS = 4  # rows packed together
_BLOCK_BYTES, _GROUP = 34, 16
_CHUNK_ROWS = 16384  # rows packed per pass (bounds the temporaries)


def packs(qtype: int, shape: tuple[int, ...]) -> bool:
    """Whether a weight of this ggml type and block-byte shape [N, K / 32 * 34] takes the lane layout: Q8_0, N a
    multiple of 4, K a multiple of 512 or 128 past one."""
    if qtype != 8 or len(shape) != 2 or shape[0] % ROWS or shape[1] % _BLOCK_BYTES:
        return False
    return shape[1] // _BLOCK_BYTES % _GROUP in (0, ROWS)


def _split(data: torch.Tensor) -> tuple[int, int, int]:
    n, row_bytes = data.shape
    blocks = row_bytes // _BLOCK_BYTES
    return n, blocks // _GROUP, blocks % _GROUP


def pack(data: torch.Tensor) -> torch.Tensor:
    """Q8_0 block bytes [N, K / 32 * 34] -> the same weight in the lane layout (same shape)."""
    out = torch.empty_like(data)
    for r0 in range(0, data.shape[0], _CHUNK_ROWS):
        out[r0:r0 + _CHUNK_ROWS] = _pack(data[r0:r0 + _CHUNK_ROWS])
    return out


def _pack(data: torch.Tensor) -> torch.Tensor:
    n, groups, tail = _split(data)
    b = data.reshape(n, -1, _BLOCK_BYTES)
    d, q = b[..., :2], b[..., 2:] ^ 0x80
    full_d = d[:, :groups * _GROUP].reshape(n, groups, 2 * _GROUP)
    full_q = q[:, :groups * _GROUP].reshape(n, groups, _GROUP, 8, 4).transpose(2, 3).reshape(n, groups, 32 * _GROUP)
    full = torch.cat((full_d, full_q), dim=2).reshape(n // ROWS, ROWS * groups * _GROUP * _BLOCK_BYTES)
    tail_d = d[:, groups * _GROUP:].reshape(n // ROWS, 2 * ROWS * tail)
    tail_q = q[:, groups * _GROUP:].reshape(n // ROWS, ROWS * tail, 8, 4).transpose(1, 2).reshape(n // ROWS, 32 * ROWS * tail)
    return torch.cat((full, tail_d, tail_q), dim=1).reshape(n, -1)


def unpack(data: torch.Tensor) -> torch.Tensor:
    """The lane layout [N, K / 32 * 34] (N a multiple of 4) -> the file's Q8_0 block bytes."""
    n, groups, tail = _split(data)
    rows = data.reshape(n // ROWS, -1)
    full_bytes = ROWS * groups * (_GROUP * _BLOCK_BYTES)
    full = rows[:, :full_bytes].reshape(n, groups, _GROUP * _BLOCK_BYTES)
    full_d = full[..., :2 * _GROUP].reshape(n, groups * _GROUP, 2)
    full_q = full[..., 2 * _GROUP:].reshape(n, groups, 8, _GROUP, 4).transpose(2, 3).reshape(n, groups * _GROUP, 32)
    tail_d = rows[:, full_bytes:full_bytes + 2 * ROWS * tail].reshape(n, tail, 2)
    tail_q = rows[:, full_bytes + 2 * ROWS * tail:].reshape(n // ROWS, 8, ROWS * tail, 4).transpose(1, 2)
    d = torch.cat((full_d, tail_d), dim=1)
    q = torch.cat((full_q, tail_q.reshape(n, tail, 32)), dim=1) ^ 0x80
    return torch.cat((d, q), dim=2).reshape(n, -1)


def unpack_rows(data: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The file's Q8_0 block bytes of rows `index` (1-D) of a weight in the lane layout."""
    quads = data.reshape(data.shape[0] // ROWS, -1)[index // ROWS]
    return unpack(quads.reshape(-1, data.shape[1])).reshape(-1, ROWS, data.shape[1])[
        torch.arange(index.numel()), index % ROWS]
