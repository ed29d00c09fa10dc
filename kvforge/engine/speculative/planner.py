"""Adaptive speculation: how many tokens each sequence drafts in the coming step.

Each sequence keeps `rate`, an exponential moving average of its per-position acceptance (the chance a
draft is accepted given that the drafts before it were), updated from every position verification judged.
A step's cost grows with its rows, T(rows) = 1 + verify_row_cost * rows, in units of the step's fixed cost
(weights read once, Python per step), up to the layer bridge's row limit; above it a step pays a jump and rows
at another rate (engine/step_cost.py). A step of B decoding sequences emits B tokens plus the accepted
drafts, and the j-th draft of a sequence adds rate**j expected tokens for one row (plus the drafter's own work per
row and per draft depth, for model drafters). The planner adds draft rows in order of expected tokens while one
more row raises expected tokens per unit of cost; since the bar rises with every row taken and the offers
fall, a small batch gets long drafts and a large one only its most promising sequences' first drafts. Where the
drafts on offer could carry a step past the limit, it plans both ways (at most the limit; enough rows past it
to pay for the jump) and keeps the one with more expected tokens per unit of cost.

A sequence that the plan gives no drafts stops learning its rate; after `probe_interval` such steps it drafts
one token anyway (a probe), and each failed probe doubles its wait up to `max_probe_interval`, so text that
becomes repetitive later regains speculation. With a model drafter, probes wait for every probe_interval-th step,
so the probes of a batch share one drafter forward. Every decision is a function of past acceptance only (no
clock), so outputs and counters are reproducible.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from kvforge.engine.step_cost import StepCost

PRIOR_ACCEPTANCE = 0.5  # the rate of a sequence that has not been verified yet


@dataclass
class SequenceAcceptance:
    rate: float
    backoff: int  # steps without drafts before the next probe
    idle_steps: int = 0  # steps in a row the plan gave this sequence no drafts


@dataclass(frozen=True)
class Candidate:
    key: str
    max_drafts: int  # drafts it could make this step (room, drafter's proposal)


class SpeculationPlanner:
    def __init__(self, row_cost: float | StepCost, smoothing: float, probe_interval: int, max_probe_interval: int,
                 draft_fraction: float = 0.0):
        """row_cost: the step cost (engine/step_cost.py), or one line's cost of a row;
        draft_fraction: a drafted token's drafter work as a fraction of a target row (0 for prompt lookup);
        each draft depth then also costs draft_fraction of a step's fixed cost (one drafter forward)."""
        self.cost = row_cost if isinstance(row_cost, StepCost) else StepCost(row_cost)
        self.smoothing = smoothing
        self.probe_interval, self.max_probe_interval = probe_interval, max_probe_interval
        self.draft_fraction = draft_fraction
        self.states: dict[str, SequenceAcceptance] = {}
        self.probing: set[str] = set()  # keys whose drafts this step are a probe
        self.num_plans = 0
        self.num_skipped_low_acceptance = 0  # sequence-steps with no drafts: its rate would not pay even alone
        self.num_skipped_batch_cost = 0  # sequence-steps with no drafts: its rate pays alone, not in this batch
        self.num_probes = 0
        self.num_trimmed_tokens = 0  # drafts the candidates could have made that the plan left out

    def state(self, key: str) -> SequenceAcceptance:
        s = self.states.get(key)
        if s is None:
            s = self.states[key] = SequenceAcceptance(PRIOR_ACCEPTANCE, self.probe_interval)
        return s

    def plan(self, candidates: list[Candidate], num_decoding: int) -> dict[str, int]:
        """Drafts per candidate key. num_decoding: the step's one-token rows (every decoding sequence)."""
        self.probing.clear()
        self.num_plans += 1
        plan = self._choose(candidates, num_decoding)
        for cand in candidates:
            self._settle(cand, plan)
        return plan

    def _choose(self, candidates: list[Candidate], num_decoding: int) -> dict[str, int]:
        """Where the step could cross the cost's row limit: the better of the best plan within it and the best plan
        above it (enough drafts to pay for the jump), by expected tokens per unit of cost; a tie keeps fewer rows."""
        cost = self.cost
        most = num_decoding + sum(max(0, cand.max_drafts) for cand in candidates)
        if cost.linear or cost.within(most) or not cost.within(num_decoding):
            return self._fill(candidates, num_decoding)[0]
        below, below_rate = self._fill(candidates, num_decoding, max_rows=cost.limit)
        above, above_rate = self._fill(candidates, num_decoding, min_rows=cost.limit + 1)
        return above if above_rate > below_rate else below

    def _fill(self, candidates: list[Candidate], num_decoding: int, min_rows: int = 0,
              max_rows: int | None = None) -> tuple[dict[str, int], float]:
        """Draft rows in order of expected tokens while one more raises expected tokens per unit of cost; rows up to
        min_rows are taken regardless, none past max_rows. Returns the plan and its expected tokens per unit of cost."""
        cost, f = self.cost, self.draft_fraction
        rows = num_decoding
        tokens, spent = float(num_decoding), cost(rows)
        depth_open = 0
        plan = {cand.key: 0 for cand in candidates}
        limit = {cand.key: cand.max_drafts for cand in candidates}
        offers = [(-self.state(cand.key).rate, cand.key, 1) for cand in candidates if cand.max_drafts > 0]
        heapq.heapify(offers)
        while offers and (max_rows is None or rows < max_rows):
            neg_gain, key, j = heapq.heappop(offers)
            crossing = cost.within(rows) != cost.within(rows + 1)
            row = cost(rows + 1) - cost(rows) + cost.row_cost * f if crossing else cost.slope(rows + 1) * (1 + f)
            gain, extra = -neg_gain, row + (f if j > depth_open else 0.0)
            if rows >= min_rows and gain * spent <= extra * tokens:  # one more row would lower tokens per cost
                continue
            plan[key] = j
            rows, tokens, spent, depth_open = rows + 1, tokens + gain, spent + extra, max(depth_open, j)
            if j < limit[key]:
                heapq.heappush(offers, (neg_gain * self.states[key].rate, key, j + 1))
        return plan, tokens / spent

    def _settle(self, cand: Candidate, plan: dict[str, int]) -> None:
        if cand.max_drafts <= 0:
            return
        s = self.states[cand.key]
        if plan[cand.key]:
            s.idle_steps, s.backoff = 0, self.probe_interval
            self.num_trimmed_tokens += cand.max_drafts - plan[cand.key]
            return
        s.idle_steps += 1
        c, f = self.cost.row_cost, self.draft_fraction
        if s.idle_steps > s.backoff and self._probe_step():
            plan[cand.key] = 1
            s.idle_steps = 0
            self.probing.add(cand.key)
            self.num_probes += 1
            self.num_trimmed_tokens += cand.max_drafts - 1
        elif s.rate * (1 + c) <= c * (1 + f) + f:  # its first draft would not pay for its row in a step of its own
            self.num_skipped_low_acceptance += 1
        else:
            self.num_skipped_batch_cost += 1

    def _probe_step(self) -> bool:
        """Model drafters probe only every probe_interval-th plan, so the probes of a batch share one drafter forward."""
        return self.draft_fraction == 0 or self.num_plans % self.probe_interval == 0

    def record(self, key: str, drafted: int, accepted: int) -> None:
        """Verification kept `accepted` of `drafted` tokens: positions 1..accepted count as accepted, the next one
        (if any) as rejected."""
        s = self.state(key)
        probe = key in self.probing
        self.probing.discard(key)
        w = self.smoothing
        for _ in range(accepted):
            s.rate += w * (1.0 - s.rate)
        if accepted < drafted:
            s.rate -= w * s.rate
        if probe:
            s.backoff = self.probe_interval if accepted else min(2 * s.backoff, self.max_probe_interval)

    def retain(self, keys: set[str]) -> None:
        """Forget sequences that no longer run."""
        for key in [k for k in self.states if k not in keys]:
            del self.states[key]
        self.probing &= keys

    def stats(self) -> dict:
        return {"spec_num_skipped_low_acceptance": self.num_skipped_low_acceptance,
                "spec_num_skipped_batch_cost": self.num_skipped_batch_cost,
                "spec_num_probes": self.num_probes,
                "spec_num_trimmed_draft_tokens": self.num_trimmed_tokens}
