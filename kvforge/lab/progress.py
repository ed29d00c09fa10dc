"""One progress bar over the lab's cells on stderr: elapsed time, the running cell's time and an ETA from each
cell's rough cost, redrawn every second on a terminal (one line per cell otherwise)."""
from __future__ import annotations

import sys
import threading
import time

from kvforge.lab.cells import Cell, cost


def clock(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


class CellProgress:
    def __init__(self, cells: list[Cell], enabled: bool = True, width: int = 24):
        self.total_cost = sum(cost(c) for c in cells) or 1.0
        self.count, self.enabled, self.width = len(cells), enabled, width
        self.done_cost, self.done, self.start = 0.0, 0, time.monotonic()
        self.cell: Cell | None = None
        self.cell_start = self.start
        self.live = enabled and sys.stderr.isatty()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def eta(self) -> float | None:
        if not self.done_cost:
            return None
        elapsed = time.monotonic() - self.start
        return max(0.0, elapsed / self.done_cost * (self.total_cost - self.done_cost) - (time.monotonic() - self.cell_start))

    def line(self) -> str:
        frac = self.done_cost / self.total_cost
        bar = "#" * int(frac * self.width) + "." * (self.width - int(frac * self.width))
        eta = self.eta()
        now = time.monotonic()
        what = f"  {self.cell.name} ({clock(now - self.cell_start)})" if self.cell else "  done"
        return (f"[lab] [{bar}] {self.done}/{self.count} cells  {clock(now - self.start)} elapsed"
                f"  ETA {clock(eta) if eta is not None else '?'}{what}")

    def _draw(self, end: str = "\n") -> None:
        print(("\r\033[K" if self.live else "") + self.line(), end=end, file=sys.stderr, flush=True)

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            self._draw(end="")

    def begin(self, cell: Cell) -> None:
        self.cell, self.cell_start = cell, time.monotonic()
        if not self.enabled:
            return
        self._draw(end="" if self.live else "\n")
        if self.live and self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()

    def finish(self, cell: Cell) -> None:
        self.done += 1
        self.done_cost += cost(cell)

    def close(self) -> None:
        """Stop redrawing (also after Ctrl-C) and leave the last line on screen."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self.enabled:
            self.cell = None
            self._draw()
