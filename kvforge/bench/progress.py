"""A minimal progress line on stderr (no dependency)."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total: int, enabled: bool = True):
        self.label, self.total, self.enabled = label, total, enabled
        self.done, self.start, self.last = 0, time.monotonic(), 0.0

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self.last > 0.5 or self.done >= self.total):
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            print(f"\r{self.label}: {self.done}/{self.total} ({rate:.1f}/s)", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr, flush=True)
