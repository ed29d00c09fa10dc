"""results.json: every finished cell's figures (with the command that reproduces them), grouped for the plots."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvforge.lab.matrix import BASELINE
from kvforge.version import package_version


def pareto(points: list[tuple[float, float]]) -> list[bool]:
    """True for points no other point beats on both axes (lower memory and lower loss), ties kept."""
    return [not any(a <= x and b <= y and (a < x or b < y) for a, b in points) for x, y in points]


def quality_rows(records: dict) -> tuple[dict | None, list[dict]]:
    """The fp32 full-cache baseline and one row per format/policy cell, deltas against the baseline.

    Panel cells (one per text) fold into one row per configuration: delta_pct is the worst text's,
    with mean_delta_pct, worst_text and every text's delta beside it."""
    texts: dict[str | None, dict[str, tuple]] = {}
    for c, r in records.items():
        if c.kind == "quality":
            texts.setdefault(c.params.get("text"), {})[c.label.split(" @ ")[0]] = (c, r["result"])
    per_text = {t: _text_rows(cells) for t, cells in texts.items()}
    if list(per_text) in ([], [None]):
        base, rows = per_text.get(None, (None, []))
    else:
        base, rows = _fold(per_text)
    if base:
        for row, front in zip(rows, pareto([(r["kv_bytes_held_per_token"], r["delta_pct"]) for r in rows])):
            row["pareto"] = front
    return base, rows


def _text_rows(cells: dict[str, tuple]) -> tuple[dict | None, list[dict]]:
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
    return base, rows


def _fold(per_text: dict[str, tuple]) -> tuple[dict | None, list[dict]]:
    """One row per label over the texts whose baseline has run: the worst text's figures, plus the mean."""
    scored = {t: {r["label"]: r for r in rows} for t, (base, rows) in per_text.items() if base}
    if not scored:
        return None, []
    labels = list(dict.fromkeys(label for rows in scored.values() for label in rows))
    out = []
    for label in labels:
        have = {t: rows[label] for t, rows in scored.items() if label in rows}
        worst = max(have, key=lambda t: have[t]["delta_pct"])
        deltas = {t: r["delta_pct"] for t, r in have.items()}
        out.append({**have[worst], "worst_text": worst, "deltas": deltas,
                    "mean_delta_pct": sum(deltas.values()) / len(deltas),
                    "kv_bytes_held_per_token": max(r["kv_bytes_held_per_token"] for r in have.values())})
    return {"texts": {t: per_text[t][0] for t in scored}, **per_text[next(iter(scored))][0]}, out


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


def retrieval_rows(records: dict) -> dict | None:
    """The retrieval suite: the full cache's accuracy (the ceiling) and one row per method and share kept, each with
    its mean accuracy, the KV its questions were answered from against the full cache's (kv_fraction; the peak
    beside it) and its worst ratio on the items the full cache solves."""
    from kvforge.eval.retrieval import SOLVED

    cells = [(c, r["result"]) for c, r in records.items() if c.kind == "retrieval"]
    if not cells:
        return None
    full = next((r for c, r in cells if c.params["policy"] is None), None)
    rows = []
    for c, r in cells:
        acc = [a for by in r["accuracy"].values() for a in by.values()]
        row = {"label": c.label, "policy": c.params["policy"], "budget": c.params["budget"], **r,
               "mean_accuracy": sum(acc) / len(acc)}
        if full:
            row["kv_fraction"] = r["context_kv_bytes"] / full["context_kv_bytes"]  # KV the questions are answered from
            row["peak_kv_fraction"] = r["peak_kv_bytes"] / full["peak_kv_bytes"]
            ratios = [r["accuracy"][t][n] / a for t, by in full["accuracy"].items() for n, a in by.items()
                      if a >= SOLVED]
            row["worst_solved_ratio"] = min(ratios) if ratios else None
        rows.append(row)
    return {"settings": {k: v for k, v in cells[0][0].params.items() if k not in ("policy", "budget")},
            "full": full, "rows": rows}


def one(records: dict, kind: str) -> dict | None:
    return next((r["result"] for c, r in records.items() if c.kind == kind), None)


def build_results(run, ctx, options) -> dict[str, Any]:
    base, rows = quality_rows(run.records)
    speed = {c.label: r["result"] for c, r in run.records.items() if c.kind == "speed"}
    pending = [c.name for c in run.cells if not c.skip and c not in run.records]
    return {
        "kvforge_version": package_version(), "model": ctx.loaded.path, "text": ctx.text_name, "mode": options.mode,
        "settings": asdict(ctx.settings),
        "run": {"seconds": run.seconds, "measured": run.measured, "reused": run.reused,
                "interrupted": run.interrupted, "pending": pending},
        "baseline": base, "quality": rows, "retrieval": retrieval_rows(run.records), "heatmap": options.heatmap
        or next(iter(options.methods), None), "speed": speed, "passkey": passkey_grid(run.records),
        "long": one(run.records, "long"), "advise": one(run.records, "advise"),
        "speculative": one(run.records, "speculative"),
        "skipped": [{"kind": c.kind, "label": c.label, "note": c.skip} for c in run.cells if c.skip],
    }
