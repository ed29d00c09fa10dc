"""A progress bar on stderr (no dependency): label, bar, count, rate and time left."""
from __future__ import annotations

import sys
import time

WIDTH = 24


class Progress:
    def __init__(self, label: str, total: int, enabled: bool = True):
        self.label, self.total, self.enabled = label, max(total, 1), enabled
        self.done, self.start, self.last = 0, time.monotonic(), 0.0

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self.last > 0.5 or self.done >= self.total):
            self.last = now
            print("\r" + self.line(now), end="", file=sys.stderr, flush=True)

    def line(self, now: float | None = None) -> str:
        elapsed = max((now or time.monotonic()) - self.start, 1e-9)
        rate = self.done / elapsed
        filled = min(WIDTH, WIDTH * self.done // self.total)
        left = (self.total - self.done) / rate if rate > 0 and self.done < self.total else 0.0
        return (f"{self.label}: [{'#' * filled}{'.' * (WIDTH - filled)}] {self.done}/{self.total} "
                f"({rate:.1f}/s, {elapsed:.0f}s elapsed, ~{left:.0f}s left)")

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr, flush=True)


def default_enabled() -> bool:
    """Bars by default when a person watches stderr."""
    return sys.stderr.isatty()
