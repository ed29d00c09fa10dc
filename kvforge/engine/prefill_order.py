"""Which waiting requests start their prefill this step: shortest remaining prefill first, in groups sized to
the step's cost, so that the mean time to first token is smallest (SGLang's and vLLM's default is arrival order).

A step of x prefill tokens costs `fixed + token_cost * x` in units of a step's fixed cost (the rows the step already
runs, decodes of running requests, add to `fixed`). With the waiting requests' uncached tokens sorted ascending, the
best split into steps is contiguous (batch scheduling under the sum of completion times, Coffman et al. 1990), and
`first_group` finds it by dynamic programming: when many short requests wait behind a fixed cost, they share a step;
when their work dwarfs it, they go one by one. A request that later ones have overtaken by more than
`overtake_tokens` prefill tokens goes first, so nothing starves under a stream of short requests.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvforge.engine.sequence import Sequence
from kvforge.engine.step_cost import ROW_COST

MAX_PLANNED = 32  # requests the split looks at a step (the rest wait their turn in order)


@dataclass
class PrefillOrder:
    token_cost: float  # one prefill token's cost as a fraction of a step's fixed cost
    overtake_tokens: int  # later requests' prefill tokens a waiting request lets go first, at most
    row_cost: float = ROW_COST  # one row already in the step (a decode), the same unit

    def plan(self, waiting: deque[Sequence], cached, budget: int, rows: int) -> int:
        """Reorder `waiting` in place and return how many fresh requests (never run, not held back) to admit this
        step. cached(seq): the tokens of seq the prefix cache already holds; rows: rows already in the step."""
        held, starved, rest = [], [], []
        for s in waiting:
            if not fresh(s):
                held.append(s)
            elif s.overtaken_tokens > self.overtake_tokens:
                starved.append(s)
            else:
                rest.append(s)
        works = {s.request_id: max(1, s.num_tokens - cached(s)) for s in rest[:4 * MAX_PLANNED]}
        rest[:len(works)] = sorted(rest[:len(works)], key=lambda s: works[s.request_id])
        waiting.clear()
        waiting.extend(held + starved + rest)
        if starved:
            return len(starved)
        planned = [works[s.request_id] for s in rest[:MAX_PLANNED]]
        return first_group(planned, budget, 1 + self.row_cost * rows, self.token_cost)

    @staticmethod
    def overtaken(waiting: deque[Sequence], admitted: Sequence, tokens: int) -> None:
        """admitted starts with `tokens` prefill tokens: every fresh request that arrived before it is overtaken."""
        for seq in waiting:
            if fresh(seq) and seq.metrics.arrival_time < admitted.metrics.arrival_time:
                seq.overtaken_tokens += tokens


def fresh(seq: Sequence) -> bool:
    """A request that never ran (no preemption, nothing computed): the only kind the order may move."""
    return seq.metrics.preemptions == 0 and seq.num_computed_tokens == 0 and not seq.num_output_tokens


def first_group(works: list[int], budget: int, fixed: float, token_cost: float) -> int:
    """How many of `works` (ascending uncached tokens) to start this step: the first of `groups`."""
    return groups(works, budget, fixed, token_cost)[0] if works else 0


def groups(works: list[int], budget: int, fixed: float, token_cost: float) -> list[int]:
    """The sizes of consecutive steps' groups of `works` that minimize the sum of their completion times when a
    step costs `fixed + token_cost * its tokens`; each group fits `budget` (one request larger than it goes alone,
    in chunks)."""
    n = len(works)
    best = [0.0] * (n + 1)  # best[i]: the least cost of works[i:] once the requests before i are done
    size = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        best[i], tokens = float("inf"), 0
        for j in range(i + 1, n + 1):
            tokens += works[j - 1]
            if tokens > budget and j > i + 1:
                break
            cost = (n - i) * step_time(min(tokens, budget), fixed, token_cost) + best[j]
            if cost < best[i]:
                best[i], size[i] = cost, j - i
    out, i = [], 0
    while i < n:
        out.append(size[i])
        i += size[i]
    return out


def step_time(tokens: int, fixed: float, token_cost: float) -> float:
    return fixed + token_cost * tokens
