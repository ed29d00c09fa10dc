"""One progress bar over the lab's cells on stderr, with elapsed time and an ETA from each cell's rough cost."""
from __future__ import annotations

import sys
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

    def eta(self) -> float | None:
        if not self.done_cost:
            return None
        elapsed = time.monotonic() - self.start
        return elapsed / self.done_cost * (self.total_cost - self.done_cost)

    def line(self, cell: Cell | None) -> str:
        frac = self.done_cost / self.total_cost
        bar = "#" * int(frac * self.width) + "." * (self.width - int(frac * self.width))
        eta = self.eta()
        what = f"  {cell.kind}: {cell.label}" if cell else "  done"
        return (f"[lab] [{bar}] {self.done}/{self.count} cells  {clock(time.monotonic() - self.start)} elapsed"
                f"  ETA {clock(eta) if eta is not None else '?'}{what}")

    def begin(self, cell: Cell) -> None:
        if self.enabled:
            print(self.line(cell), file=sys.stderr, flush=True)

    def finish(self, cell: Cell) -> None:
        self.done += 1
        self.done_cost += cost(cell)

    def close(self) -> None:
        if self.enabled:
            print(self.line(None), file=sys.stderr, flush=True)
