"""Dequantization speed: kvforge's torch block decoders vs the `gguf` package's numpy ones, on one GGUF's tensors.

python -m kvforge.bench.dequant [MODEL]   (MODEL: a .gguf path or a packaged name; default gemma3-270m)
"""
from __future__ import annotations

import sys
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

from kvforge.models.gguf_header import open_gguf, read_gguf_header
from kvforge.models.gguf_quants import DEQUANTIZE, dequantize_torch
from kvforge.models.packaged import packaged_model_path


def compare(path: str) -> dict[str, float]:
    """Seconds to dequantize every tensor of a block type both handle, each way, in one run."""
    buf = open_gguf(path)
    raws = [(t, np.frombuffer(buf, np.uint8, t.nbytes, t.start).reshape(t.shape[0], -1))
            for t in read_gguf_header(path, buf)[1] if t.qtype in DEQUANTIZE and len(t.shape) == 2]
    start = time.perf_counter()
    for t, raw in raws:
        dequantize(raw, t.qtype)
    middle = time.perf_counter()
    for t, raw in raws:
        dequantize_torch(torch.from_numpy(raw.copy()), t.qtype, GGML_QUANT_SIZES[t.qtype][1])
    end = time.perf_counter()
    return {"tensors": len(raws), "gguf_s": middle - start, "torch_s": end - middle,
            "speedup": (middle - start) / (end - middle)}


if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else "gemma3-270m"
    print(compare(packaged_model_path(name) or name))
