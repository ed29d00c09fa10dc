"""The lab's figures (matplotlib, no display): each returns a Figure, or None when its cells did not run."""
from __future__ import annotations

import os
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter


@dataclass
class Plot:
    name: str  # file stem: plots/NAME.png and .svg
    title: str
    caption: str
    png: str = ""
    svg: str = ""


def _loss_axis(ax, values: list[float]) -> None:
    """Perplexity increase in %: linear while small, symmetric-log once some configuration loses a lot."""
    if max(abs(v) for v in values) > 20:
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_ylim(bottom=min(values) - 0.1)
    ax.set_ylabel("perplexity increase vs fp32 full cache (%)")
    ax.axhline(0, color="grey", lw=0.6)


def _finish(ax, xlabel: str) -> None:
    ax.set_xlabel(xlabel)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _kind(r: dict) -> str:
    if r["policy"] and r["format"] != "fp32":
        return "both"
    if r["policy"]:
        return "share" if isinstance(r["budget"], float) else "policy"
    return "format"


def frontier(res: dict) -> Figure | None:
    rows = [r for r in res["quality"] if "delta_pct" in r]
    if len(rows) < 2:
        return None
    fig, ax = plt.subplots(figsize=(8, 5), layout="constrained")
    kinds = {"format": ("o", "tab:blue"), "policy": ("s", "tab:orange"), "share": ("D", "tab:purple"),
             "both": ("^", "tab:green")}
    for r in rows:
        kind = _kind(r)
        marker, color = kinds[kind]
        ax.scatter(r["kv_bytes_held_per_token"], r["delta_pct"], marker=marker, color=color,
                   edgecolors="black" if r.get("pareto") else "none", s=60 if r.get("pareto") else 30, zorder=3)
    labels: dict[tuple[float, float], list[str]] = {}  # configurations that measure the same share one label
    for r in rows:
        labels.setdefault((r["kv_bytes_held_per_token"], r["delta_pct"]), []).append(r["label"])
    right = max(x for x, _ in labels)
    for (x, y), names in labels.items():
        at_edge = x > right * 0.9  # label the rightmost points below and to their left, inside the axes
        ax.annotate(", ".join(names), (x, y), fontsize=7, xytext=(-4, -11) if at_edge else (4, 3),
                    textcoords="offset points",
                    ha="right" if at_edge else "left").set_in_layout(False)
    front = sorted((r["kv_bytes_held_per_token"], r["delta_pct"]) for r in rows if r.get("pareto"))
    ax.step(*zip(*front), where="post", color="black", lw=1, label="Pareto set", zorder=2)
    for kind, (marker, color) in kinds.items():
        ax.scatter([], [], marker=marker, color=color, label={"format": "KV format", "policy": "eviction policy (fp32)",
                                                                "share": "policy keeping a share of the sequence",
                                                                "both": "policy x format"}[kind])
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    _loss_axis(ax, [r["delta_pct"] for r in rows])
    _finish(ax, f"KV bytes held at peak per token of text (over {res['settings']['tokens']} tokens)")
    return fig


def speed(res: dict) -> Figure | None:
    rows = res["speed"]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 4), layout="constrained")
    labels = list(rows)
    ax.bar(range(len(labels)), [rows[k]["decode_tok_s"] for k in labels], color="tab:blue")
    fp32 = sorted(r["fp32_decode_tok_s"] for r in rows.values())[len(rows) // 2]
    ax.axhline(fp32, color="black", ls="--", lw=1, label=f"fp32 cache ({fp32:.0f} tok/s, median over cells)")
    for i, k in enumerate(labels):
        ratio = rows[k]["decode_tok_s"] / rows[k]["fp32_decode_tok_s"]  # fp32 timed in the same cell
        ax.annotate(f"{ratio:.2f}x fp32", (i, rows[k]["decode_tok_s"]), ha="center",
                    fontsize=8, xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=8)
    s = res["settings"]["speed"]
    ax.set_ylabel(f"decode tok/s (batch {s['batch']}, {s['seq_len']}-token context)")
    ax.set_title(f"median of {s['rounds']} interleaved rounds x {s['steps']} steps per format", fontsize=8)
    ax.legend(fontsize=8)
    return fig


def budgets(res: dict) -> Figure | None:
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in res["quality"]:
        if r["policy"] and "delta_pct" in r:
            key = r["policy"] + ("" if r["format"] == "fp32" else f" + {r['format']}")
            kept = r["budget"] if isinstance(r["budget"], int) else round(r["budget"] * res["settings"]["tokens"])
            lines.setdefault(key, []).append((kept, r["delta_pct"]))
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    for key, pts in sorted(lines.items()):
        xs, ys = zip(*sorted(pts))
        ax.plot(xs, ys, marker="o", ls="-" if "+" not in key else "--", label=key)
    ax.set_xscale("log", base=2)
    ticks = sorted({b for pts in lines.values() for b, _ in pts})
    ax.set_xticks(ticks, [str(b) for b in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    _loss_axis(ax, [y for pts in lines.values() for _, y in pts])
    _finish(ax, f"KV budget (tokens kept, of {res['settings']['tokens']})")
    return fig


def position(res: dict) -> Figure | None:
    r = res["long"]
    if not r:
        return None
    seg = res["settings"]["long"]["segment"]
    fig, ax = plt.subplots(figsize=(8, 4), layout="constrained")
    ends = [seg * (i + 1) for i in range(len(r["segments"]))]
    ax.plot(ends, r["segments"], marker="o", label=f"StreamingLLM, budget {res['settings']['long']['budget']}")
    if "segments_baseline" in r:
        ax.plot(ends[:len(r["segments_baseline"])], r["segments_baseline"], marker="s", ls="--",
                label="fp32 full cache (within the context)")
    ax.axvline(res["settings"]["context"], color="grey", ls=":", label=f"model context ({res['settings']['context']})")
    ax.set_ylabel("perplexity of the segment")
    kv = ax.twinx()
    kv.plot(ends, [b / 2**20 for b in r["segment_peak_kv_bytes"]], color="tab:red", marker=".", lw=0.8)
    kv.set_ylabel("peak KV in the segment (MiB)", color="tab:red")
    kv.set_ylim(0, max(r["segment_peak_kv_bytes"]) / 2**20 * 1.3)
    _finish(ax, f"position (end of each {seg}-token segment)")
    return fig


def passkey(res: dict) -> Figure | None:
    g = res["passkey"]
    if not g:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(9, 1.2 + 0.6 * len(g["lengths"])), sharey=True, layout="constrained")
    for ax, key, title in ((axes[0], "full", "full cache"), (axes[1], "with_policy", f"{g['policy']}, budget {g['budget']}")):
        im = ax.imshow(g[key], vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i, row in enumerate(g[key]):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(g["depths"])), g["depths"])
        ax.set_yticks(range(len(g["lengths"])), g["lengths"])
        ax.set_xlabel("needle depth")
        ax.set_title(title, fontsize=9)
    axes[0].set_ylabel("prompt length (tokens)")
    fig.colorbar(im, ax=axes, label="accuracy")
    return fig


def retrieval_frontier(res: dict) -> Figure | None:
    """Mean retrieval accuracy against the KV held when the questions began (share of the full cache's), per method."""
    r = res.get("retrieval")
    if not r or not r["full"] or len(r["rows"]) < 2:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    lines: dict[str, list[tuple[float, float, float]]] = {}
    for row in r["rows"]:
        if row["policy"]:
            lines.setdefault(row["policy"], []).append((row["kv_fraction"], row["mean_accuracy"], row["budget"]))
    for name, pts in sorted(lines.items()):
        pts.sort()
        ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], marker="o", label=name)
        for x, y, b in pts:
            ax.annotate(f"{b:g}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    full = next(row for row in r["rows"] if not row["policy"])
    ax.scatter([1.0], [full["mean_accuracy"]], marker="*", s=120, color="black", zorder=3, label="full cache")
    ax.set_ylim(-0.03, 1.03)
    ax.set_ylabel("mean exact-match accuracy (every task and length)")
    _finish(ax, "KV held when the questions begin, share of the full cache's (labels: share of the sequence kept)")
    return fig


def retrieval_heatmap(res: dict) -> Figure | None:
    """Accuracy per task and length (rows) and share kept (columns) for one method, the full cache last."""
    r, method = res.get("retrieval"), res.get("heatmap")
    rows = sorted((row for row in (r or {}).get("rows", []) if row["policy"] == method), key=lambda row: row["budget"])
    if not rows or not r["full"]:
        return None
    columns = [*rows, {"budget": "full", "accuracy": r["full"]["accuracy"]}]
    items = [(t, n) for t, by in r["full"]["accuracy"].items() for n in by]
    grid = [[col["accuracy"][t][n] for col in columns] for t, n in items]
    fig, ax = plt.subplots(figsize=(1.6 + 1.0 * len(columns), 0.9 + 0.38 * len(items)), layout="constrained")
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i, line in enumerate(grid):
        for j, v in enumerate(line):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(columns)), [str(c["budget"]) for c in columns])
    ax.set_yticks(range(len(items)), [f"{t} @ {n}" for t, n in items], fontsize=8)
    ax.set_xlabel(f"{method}: share of the sequence kept (full: the full cache, the ceiling)")
    fig.colorbar(im, ax=ax, label="accuracy")
    return fig


def advisor(res: dict) -> Figure | None:
    a = res["advise"]
    if not a or not a["rows"]:
        return None
    rows = a["rows"]
    fig, ax = plt.subplots(figsize=(8, 0.9 + 0.35 * len(rows)), layout="constrained")
    colors = ["tab:green" if r["name"] == a["choice"] else "tab:blue" if r["eligible"] else "lightgrey" for r in rows]
    ax.barh([r["name"] for r in rows], [r["score"] for r in rows], color=colors)
    ax.invert_yaxis()
    ax.set_xlabel("balanced score (lower is better; grey: over the loss limit, green: the choice)")
    return fig


PLOTS = [
    ("frontier", "Memory x quality frontier", frontier,
     ("Each point is one KV format, eviction policy or both; the outlined points joined by the step line are the "
     "Pareto set (nothing else holds less KV and loses less perplexity).")),
    ("retrieval_frontier", "Retrieval accuracy x KV memory", retrieval_frontier,
     ("Mean exact-match accuracy of the retrieval suite (several questions after one compressed context) against the "
      "KV each configuration held once its context was in (compressed), as a share of the full cache's; the star is "
      "the full cache.")),
    ("retrieval_heatmap", "Retrieval accuracy by task and budget", retrieval_heatmap,
     "Exact-match accuracy of one method per task and context length (rows) and share kept (columns)."),
    ("decode_speed", "Decode speed per KV format", speed,
     ("Median decode tokens/s with the cache filled to a fixed context; labels give the speed vs an fp32 cache timed "
     "in the same cell (interleaved rounds).")),
    ("budgets", "Perplexity increase vs KV budget, per policy", budgets,
     "Solid: policy over an fp32 cache; dashed: policy combined with a quantized format."),
    ("position", "Perplexity vs position past the context (StreamingLLM)", position,
     ("Perplexity of each segment of a text longer than the model's context, scored through a bounded cache (red: "
      "the KV it held). Segments differ in difficulty; --full adds the fp32 full cache over the segments inside "
      "the context for comparison.")),
    ("passkey", "Passkey retrieval: accuracy by length and depth", passkey,
     "Fraction of hidden keys recalled, full cache vs the policy."),
    ("advisor", "The advisor's ranking of measured candidates", advisor,
     "kvforge advise --measure on the lab's candidates (memory, quality and speed measured on this model)."),
]


def draw_all(res: dict, out_dir: str) -> list[Plot]:
    """Write every plot whose cells ran as PNG and SVG under out_dir/plots."""
    folder = os.path.join(out_dir, "plots")
    os.makedirs(folder, exist_ok=True)
    done = []
    for name, title, draw, caption in PLOTS:
        fig = draw(res)
        if fig is None:
            continue
        fig.suptitle(title, fontsize=11)
        plot = Plot(name, title, caption, os.path.join(folder, f"{name}.png"), os.path.join(folder, f"{name}.svg"))
        fig.savefig(plot.png, dpi=110, bbox_inches="tight")
        fig.savefig(plot.svg, bbox_inches="tight")
        plt.close(fig)
        done.append(plot)
    return done
