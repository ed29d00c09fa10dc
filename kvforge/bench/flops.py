"""Roofline accounting: the FLOPs and the bytes the engine's forwards needed at least, and the machine's
measured ceilings for each (fp32 matmul FLOP/s, streaming read bytes/s)."""
from __future__ import annotations

import time
import weakref

import torch
from torch import nn

from kvforge.bench.timing import Clock, Span
from kvforge.kv.memory import bytes_per_token


def measure_matmul_peak(device: torch.device, seconds: float = 1.0, m: int = 512, k: int = 576, n: int = 1536) -> Span:
    """fp32 FLOP/s of a model-shaped matmul, the roofline's compute ceiling on this machine, per second of wall
    time and of the calling thread's CPU time: the fastest of torch's F.linear and the engine's own linears
    (panel_linear, and oneDNN on a packed weight, about twice MKL here)."""
    from kvforge.ops.layers import linear
    from kvforge.ops.packed_weights import packed, packed_linear

    a = torch.randn(m, k, device=device)
    w = torch.randn(n, k, device=device)
    paths = [torch.nn.functional.linear, linear]
    if packed(w) is not None:
        paths.append(lambda x, weight: packed_linear(x, packed(weight), None))
    with torch.inference_mode():
        rates = [_rate(lambda f=fn: f(a, w), 2 * m * k * n, seconds) for fn in paths]
    return Span(max(r.wall for r in rates), max(r.cpu for r in rates))


def measure_read_bandwidth(device: torch.device, seconds: float = 1.0, mib: int = 512) -> Span:
    """Bytes/s of streaming a tensor far larger than the caches once (a sum over it), at torch's thread count,
    per second of wall time and of the calling thread's CPU time."""
    x = torch.ones(mib * 2**20 // 4, device=device)
    return _rate(x.sum, x.numel() * 4, seconds)


def _rate(fn, work: float, seconds: float) -> Span:
    """work per second of fn, after warm-up, over about `seconds` of wall time."""
    for _ in range(3):
        fn()
    reps, clock, start = 0, Clock(), time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        reps += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    spent = clock.split()
    return Span(work * reps / spent.wall, work * reps / max(spent.cpu, 1e-9))


def linear_params(model: nn.Module, exclude: tuple[str, ...] = ("lm_head",)) -> int:
    """Weights that every token multiplies (the LM head is counted per sampled token instead)."""
    return sum(m.weight.numel() for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not name.endswith(exclude))


def engine_flops(engine) -> float:
    """FLOPs the engine's forward passes performed so far: linear layers, LM head, attention."""
    model, r, cfg = engine.runner.model, engine.runner, engine.model_config
    head = model.lm_head.weight.numel()
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * r.attended_keys
    return 2.0 * _counted(model)[0] * r.forward_tokens + 2.0 * head * r.sampled_tokens + attention


def engine_bytes(engine) -> float:
    """Bytes the engine's forward passes had to move at least: every weight once per forward (the embedding
    table is read by row, not counted) and every cached row attention read, at the pool's bytes per token."""
    r, kv = engine.runner, engine.runner.kv
    per_token = bytes_per_token(kv.spec, kv.format, kv.block_size)
    return float(_counted(r.model)[1]) * r.forward_passes + per_token * r.context_rows


_COUNTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _counted(model: nn.Module) -> tuple[int, int]:
    """(linear_params, bytes of every linear weight with the LM head), counted once per model: the throughput
    bench asks every step."""
    if model not in _COUNTS:
        _COUNTS[model] = (linear_params(model), sum(m.weight.numel() * m.weight.element_size()
                                                     for m in model.modules() if isinstance(m, nn.Linear)))
    return _COUNTS[model]
