"""FLOP accounting for the roofline fraction, and the machine's measured fp32 matmul peak."""
from __future__ import annotations

import time

import torch
from torch import nn


def measure_matmul_peak(device: torch.device, seconds: float = 1.0, m: int = 512, k: int = 576, n: int = 1536) -> float:
    """fp32 FLOP/s of a model-shaped matmul, the roofline's ceiling on this machine."""
    a = torch.randn(m, k, device=device)
    w = torch.randn(n, k, device=device)
    for _ in range(3):
        torch.nn.functional.linear(a, w)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.nn.functional.linear(a, w)
        reps += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * m * k * n * reps / (time.perf_counter() - start)


def linear_params(model: nn.Module, exclude: tuple[str, ...] = ("lm_head",)) -> int:
    """Weights that every token multiplies (the LM head is counted per sampled token instead)."""
    return sum(m.weight.numel() for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not name.endswith(exclude))


def engine_flops(engine) -> float:
    """FLOPs the engine's forward passes performed so far: linear layers, LM head, attention."""
    model, r, cfg = engine.runner.model, engine.runner, engine.model_config
    head = model.lm_head.weight.numel()
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * r.attended_keys
    return 2.0 * linear_params(model) * r.forward_tokens + 2.0 * head * r.sampled_tokens + attention
