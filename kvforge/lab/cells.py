"""A lab cell: one measurement (kind + parameters) and the key under which its result is cached."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

MEASURED = ("quality", "retrieval", "speed", "long", "passkey", "advise", "speculative")
KINDS = (*MEASURED, "tiers")  # tiers: a hook until the engine has them
BASELINE_FORMAT = "fp32"


@dataclass(frozen=True)
class Cell:
    kind: str
    label: str  # what the progress line and the report call it, e.g. "int4+h2o:128"
    params: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    skip: str | None = None  # a note instead of a measurement (the input or the engine lacks something)

    @property
    def name(self) -> str:
        return f"{self.kind}: {self.label}"

    def key(self, context: dict[str, Any]) -> str:
        """Stable across processes: the kind, its parameters and the run's model, text and kvforge version."""
        blob = json.dumps({"kind": self.kind, "params": self.params, **context}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:20]

    def file_name(self, context: dict[str, Any]) -> str:
        return f"{self.kind}-{self.key(context)}.json"


def quality_label(dtype: str, policy: str | None, budget: float | None) -> str:
    return dtype + (f"+{policy}:{budget}" if policy else "")


def quality_cell(tokens: int, spec: str, policy: str | None = None, budget: int | None = None,
                 text: str | None = None) -> Cell:
    """text: a panel text this cell scores instead of the run's text (kvforge lab --panel)."""
    label = quality_label(spec, policy, budget)
    params = {"format": spec, "policy": policy, "budget": budget, "tokens": tokens, **({"text": text} if text else {})}
    return Cell("quality", f"{label} @ {text}" if text else label, params)


def retrieval_cell(suite: dict, policy: str | None = None, budget: float | None = None) -> Cell:
    """The retrieval suite's cases (tasks, lengths, contexts, ...) under the full cache or one policy."""
    return Cell("retrieval", quality_label(BASELINE_FORMAT, policy, budget), {**suite, "policy": policy, "budget": budget})


def cost(cell: Cell) -> float:
    """Rough relative time of a cell (about milliseconds on SmolLM2 over 2 cores), for the ETA."""
    p = cell.params
    if cell.skip or cell.kind not in MEASURED:
        return 0.0
    if cell.kind == "quality":
        return 6.0 * p["tokens"]
    if cell.kind == "speed":
        return 1.5 * p["seq_len"] * p["rounds"]
    if cell.kind == "retrieval":
        return 6.0 * sum(p["lengths"]) * p["contexts"] * len(p["tasks"])
    if cell.kind == "passkey":
        return 6.0 * p["length"] * len(p["depths"]) * p["trials"]
    if cell.kind == "long":
        return 3.0 * p["tokens"]
    if cell.kind == "speculative":
        return 8.0 * p["prompts"] * len(p["batches"]) * (p["passage_tokens"] + 4 * p["max_tokens"])
    return 6.0 * (p["candidates"].count(",") + 2) * (p["eval_tokens"] + 300)
