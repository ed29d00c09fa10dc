"""Weights packed into panels of 16 output columns, [P, K, 16], for kvforge::panel_linear (csrc/panel_matmul.cpp):
the tens-of-rows linear of batched decode and speculative verification. The packed copy is made when an engine is
built (models/weight_store.py, for the weights the model declares; on the meta device for a model built only to
count its bytes), else on a weight's first such use, and kept as an attribute of that weight tensor, so it lives
and dies with it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

PANEL = 16
ATTRIBUTE = "_kvforge_panels"
NO_PANELS = "_kvforge_no_panels"  # set on a weight that keeps its one row-major copy (a tied embedding and LM head)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16]: panel p holds columns 16p..16p+15 (zeros past N), k-major."""
    n, k = weight.shape
    padded = F.pad(weight, (0, 0, 0, -n % PANEL)) if n % PANEL else weight  # pad copies even when it adds nothing
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def unpack_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:n]


def panels(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight's panel copy (made now if new), or None where panels do not apply (marked NO_PANELS included)."""
    cached = getattr(weight, ATTRIBUTE, None)
    if cached is not None:
        return cached
    if getattr(weight, NO_PANELS, False) or weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type not in ("cpu", "meta"):
        return None
    with torch.no_grad():
        cached = pack_panels(weight.detach())
    setattr(weight, ATTRIBUTE, cached)
    return cached
