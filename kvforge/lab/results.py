"""results.json: every finished cell's figures (with the command that reproduces them), grouped for the plots."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvforge.lab.matrix import BASELINE


def pareto(points: list[tuple[float, float]]) -> list[bool]:
    """True for points no other point beats on both axes (lower memory and lower loss), ties kept."""
    return [not any(a <= x and b <= y and (a < x or b < y) for a, b in points) for x, y in points]


def quality_rows(records: dict) -> tuple[dict | None, list[dict]]:
    """The fp32 full-cache baseline and one row per format/policy cell, deltas against the baseline."""
    cells = {c.label: (c, r["result"]) for c, r in records.items() if c.kind == "quality"}
    base = cells.get(BASELINE, (None, None))[1]
    rows = []
    for label, (cell, r) in cells.items():
        p = cell.params
        row = {"label": label, "format": p["format"], "policy": p["policy"], "budget": p["budget"], **r,
               "kv_bytes_held_per_token": r["peak_kv_bytes"] / r["tokens"]}
        if base:
            row["delta_pct"] = 100.0 * (r["ppl"] - base["ppl"]) / base["ppl"]  # as kvforge eval ppl computes it
            row["kv_fraction"] = r["peak_kv_bytes"] / base["peak_kv_bytes"]
        rows.append(row)
    if base:
        for row, front in zip(rows, pareto([(r["kv_bytes_held_per_token"], r["delta_pct"]) for r in rows])):
            row["pareto"] = front
    return base, rows


def passkey_grid(records: dict) -> dict | None:
    cells = sorted(((c.params, r["result"]) for c, r in records.items() if c.kind == "passkey"),
                   key=lambda pr: pr[0]["length"])
    if not cells:
        return None
    p0 = cells[0][0]
    depths = [str(d) for d in p0["depths"]]
    return {"lengths": [p["length"] for p, _ in cells], "depths": depths, "policy": p0["policy"],
            "budget": p0["budget"], "trials": p0["trials"],
            "full": [[r["full"]["accuracy"][d] for d in depths] for _, r in cells],
            "with_policy": [[r["policy"]["accuracy"][d] for d in depths] for _, r in cells],
            "commands": [r["command"] for _, r in cells]}


def one(records: dict, kind: str) -> dict | None:
    return next((r["result"] for c, r in records.items() if c.kind == kind), None)


def build_results(run, ctx, options) -> dict[str, Any]:
    from kvforge.lab.runner import kvforge_version

    base, rows = quality_rows(run.records)
    speed = {c.label: r["result"] for c, r in run.records.items() if c.kind == "speed"}
    pending = [c.name for c in run.cells if not c.skip and c not in run.records]
    return {
        "kvforge_version": kvforge_version(), "model": ctx.loaded.path, "text": ctx.text_name, "mode": options.mode,
        "settings": asdict(ctx.settings),
        "run": {"seconds": run.seconds, "measured": run.measured, "reused": run.reused,
                "interrupted": run.interrupted, "pending": pending},
        "baseline": base, "quality": rows, "speed": speed, "passkey": passkey_grid(run.records),
        "long": one(run.records, "long"), "advise": one(run.records, "advise"),
        "speculative": one(run.records, "speculative"),
        "skipped": [{"kind": c.kind, "label": c.label, "note": c.skip} for c in run.cells if c.skip],
    }
