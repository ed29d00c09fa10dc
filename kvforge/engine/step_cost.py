"""StepCost: what the target's forward of one step costs for its number of query rows, in units of a step's fixed cost.

The model runner makes it (`ModelRunner.step_cost`), as it knows which path a step of R rows takes: where the compiled
layer bridge serves the model, steps of up to `limit` rows stream every weight once for all rows,
T(rows) = 1 + row_cost * rows, and larger steps take panel tiles, T(rows) = 1 + jump + row_cost_above * rows. Without
a limit (no bridge) a step costs the first line at any size. `kvforge bench spec --verify-cost` fits the constants.
"""
from __future__ import annotations

from dataclasses import dataclass

ROW_COST = 0.09  # one more row in a step, as a share of a step's fixed cost (`kvforge bench spec --verify-cost`)


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
