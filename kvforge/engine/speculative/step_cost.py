"""StepCost: what the target's forward of one step costs for its number of query rows, in units of a step's fixed cost.

Steps of up to `limit` rows run each layer through the compiled layer bridge streaming every weight once for all
rows (kvforge.ops.layer_bridge.BRIDGE_ROWS, when the bridge serves the model): T(rows) = 1 + row_cost * rows.
Larger steps take panel tiles (the bridge on the weights' panel copies, the per-op path beyond WIDE_ROWS):
T(rows) = 1 + jump + row_cost_above * rows. Without a limit (no bridge) a step costs the first line at any size.
`kvforge bench spec --verify-cost` fits the three constants.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    row_cost: float
    limit: int | None = None  # most rows of the cheap regime; None: one line for every size
    jump: float = 0.0
    row_cost_above: float | None = None  # None: row_cost

    def __call__(self, rows: int) -> float:
        if self.within(rows):
            return 1 + self.row_cost * rows
        return 1 + self.jump + self.above * rows

    def within(self, rows: int) -> bool:
        return self.limit is None or rows <= self.limit

    def slope(self, rows: int) -> float:
        """The cost of one more row in a step that already has `rows` rows, in the same regime."""
        return self.row_cost if self.within(rows) else self.above

    @property
    def above(self) -> float:
        return self.row_cost if self.row_cost_above is None else self.row_cost_above

    @property
    def linear(self) -> bool:
        return self.limit is None or (self.jump == 0 and self.above == self.row_cost)
