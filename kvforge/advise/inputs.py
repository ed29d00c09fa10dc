"""What `kvforge advise` is told: the workload, the device and the priority, validated on construction."""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from kvforge.errors import ConfigError
from kvforge.kv.formats import KVFormat, format_names

PRIORITIES = ("quality", "balanced", "efficiency")
# perplexity increase (%) each priority accepts unless --max-quality-loss says otherwise
DEFAULT_MAX_LOSS = {"quality": 0.1, "balanced": 1.0, "efficiency": 2.0}
UNBOUNDED = "unbounded"


def parse_context(text: str | int) -> int | None:
    """Tokens from '8192', '32K' / '32k' (x1024), '1M' (x1024^2); None for 'unbounded' / 'inf'."""
    s = str(text).strip().lower()
    if s in (UNBOUNDED, "inf", "infinite"):
        return None
    m = re.fullmatch(r"(\d+)\s*([km]?)", s)
    if not m or int(m.group(1)) < 1:
        raise ConfigError(f"bad context {text!r}; give tokens per sequence (8192, 32K, 1M) or 'unbounded'")
    return int(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20}[m.group(2)]


@dataclass
class AdviseInputs:
    model: str = "smollm2-135m"  # preset, config.json (or its directory), or .gguf
    context: int | None = 0  # typical tokens per sequence; 0 = min(model context, 4096); None = unbounded
    priority: str = "balanced"
    max_quality_loss: float | None = None  # % perplexity increase; None = the priority's default
    shared_prefix: bool = False  # shared system prompts / multi-turn conversations
    memory: int | None = None  # device bytes for weights + KV
    batch: int = 1  # concurrent sequences
    weights_dtype: str | None = None  # weight estimate for configs without a file (default fp16)
    block_size: int = 16

    def __post_init__(self):
        if self.priority not in PRIORITIES:
            raise ConfigError(f"priority must be one of {', '.join(PRIORITIES)}, got {self.priority!r}")
        if self.context is not None and (not isinstance(self.context, int) or self.context < 0):
            raise ConfigError(f"context must be a positive token count or None (unbounded), got {self.context!r}")
        loss = self.max_quality_loss
        if loss is not None and (not isinstance(loss, (int, float)) or not math.isfinite(loss) or loss < 0):
            raise ConfigError(f"max_quality_loss must be a percentage >= 0, got {loss!r}")
        if not isinstance(self.batch, int) or self.batch < 1:
            raise ConfigError(f"batch must be an integer >= 1, got {self.batch!r}")
        if self.memory is not None and (not isinstance(self.memory, int) or self.memory <= 0):
            raise ConfigError(f"memory must be a positive number of bytes, got {self.memory!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ConfigError(f"block_size must be a power of two in 1..256, got {self.block_size!r}")

    @property
    def unbounded(self) -> bool:
        return self.context is None

    @property
    def tolerance(self) -> float:
        return DEFAULT_MAX_LOSS[self.priority] if self.max_quality_loss is None else float(self.max_quality_loss)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "context": UNBOUNDED if self.unbounded else self.context or "default", "tolerance": self.tolerance}


def check_format(name: str) -> None:
    if name not in KVFormat.registry:
        raise ConfigError(f"unknown KV format {name!r}; allowed: {', '.join(format_names())}")
