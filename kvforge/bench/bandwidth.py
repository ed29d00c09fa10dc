"""How close one-sequence decode comes to the memory bandwidth limit: each decode step reads every weight it
multiplies once, so weight bytes read per token x tok/s is the traffic a step needs; over a measured copy
bandwidth at the same thread count it is the fraction of the physical limit reached.

Bytes read per token: every tensor a decode step reads, the embedding table left out (a lookup reads one row)
unless it is also the LM head (tied). For llama.cpp these are the GGUF's tensors as stored; for kvforge the
layout its few-row kernels read (the row-major fp32 weight, the int8 packed weight or the GGUF blocks), not the
panel copies that only steps of many rows read.
"""
from __future__ import annotations

import os
import time

import torch
from torch import nn

from kvforge.errors import ConfigError
from kvforge.models.int8_weights import INT8, RELEASED
from kvforge.models.quant_weights import blocks_of

EMBEDDING = "token_embd.weight"
LM_HEAD = "output.weight"
COPY_BYTES = 256 << 20  # far above any last-level cache


def gguf_bytes_per_token(path: str | os.PathLike[str]) -> int:
    """Bytes of a GGUF's tensors one decode token reads: all of them but the embedding table, which is read whole
    only as a tied LM head (no output.weight)."""
    from kvforge.models.gguf_header import open_gguf, read_gguf_header

    path = os.fspath(path)
    _, tensors = read_gguf_header(path, open_gguf(path))
    tied = not any(t.name == LM_HEAD for t in tensors)
    return sum(t.nbytes for t in tensors if t.name != EMBEDDING or tied)


def _read_layout(t: torch.Tensor) -> list[torch.Tensor]:
    """The storages a few-row step reads for weight tensor t."""
    qb = blocks_of(t)
    if qb is not None:
        return [qb.data]
    packed = getattr(t, INT8, None)
    if packed:
        return list(packed)
    return [] if getattr(t, RELEASED, False) or t.device.type == "meta" else [t]


def model_bytes_per_token(model: nn.Module) -> int:
    """Bytes of the weights `model` reads per decode token (each storage once): every parameter, buffer and fused
    weight in the layout its few-row kernels read; an embedding table only when the LM head is the same tensor."""
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding) and m.weight is not head}
    storages: dict[int, int] = {}
    for module in model.modules():
        for t in (*module._parameters.values(), *module._buffers.values(), *vars(module).values()):
            if not isinstance(t, torch.Tensor) or id(t) in tables or t.dtype in (torch.int64, torch.bool):
                continue
            for s in _read_layout(t):
                storage = s.untyped_storage()
                storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def copy_bandwidth(threads: int, nbytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """Bytes per second a copy of `nbytes` moves at `threads` threads, read and written counted (STREAM's Copy
    convention), the best of `repeats`."""
    if threads < 1 or nbytes < 1 or repeats < 1:
        raise ConfigError(f"threads, nbytes and repeats must be >= 1, got {threads}, {nbytes}, {repeats}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(nbytes // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)  # pages touched before timing
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return 2 * src.nbytes / best


def bandwidth_fraction(bytes_per_token: int, tok_s: float, copy_bytes_per_s: float) -> dict:
    """The traffic one-sequence decode needs (bytes per token x tok/s) and its share of the copy bandwidth."""
    need = bytes_per_token * tok_s
    return {"weight_bytes_per_token": bytes_per_token, "decode_tok_s": tok_s, "read_bytes_per_s": need,
            "copy_bytes_per_s": copy_bytes_per_s, "fraction": need / copy_bytes_per_s}
