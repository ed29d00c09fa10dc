"""Write results.json, the plots, a self-contained report.html (images as data: URIs) and summary.md."""
from __future__ import annotations

import base64
import html
import json
import os

from kvforge.lab.plots import Plot, draw_all
from kvforge.lab.results import build_results

STYLE = ("body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}table{border-collapse:collapse;"
         "font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}th{background:#f3f3f3}"
         "td:first-child{text-align:left}.note{background:#fff6d5;padding:6px 10px}code{font-size:12px}"
         "img{max-width:100%}figcaption{font-size:13px;color:#555}")


def write_report(run, ctx, options) -> dict:
    res = build_results(run, ctx, options)
    _write(os.path.join(options.out, "results.json"), json.dumps(res, indent=1))
    plots = draw_all(res, options.out)
    _write(os.path.join(options.out, "report.html"), render_html(res, plots))
    _write(os.path.join(options.out, "summary.md"), render_summary(res))
    return res


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _esc(x) -> str:
    return html.escape(str(x))


def _table(head: list[str], rows: list[list]) -> str:
    th = "".join(f"<th>{_esc(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def _image(plot: Plot) -> str:
    with open(plot.png, "rb") as f:
        data = base64.b64encode(f.read()).decode()
    return (f'<figure><img alt="{_esc(plot.title)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{_esc(plot.caption)} (also plots/{plot.name}.png, .svg)</figcaption></figure>")


def status_lines(res: dict) -> list[str]:
    r = res["run"]
    lines = [(f"{len(r['measured'])} cells measured in this run, {len(r['reused'])} reused from earlier runs, "
             f"{r['seconds']:.0f} s in all")]
    if r["interrupted"]:
        lines.append(f"interrupted: {len(r['pending'])} cells not measured ({', '.join(r['pending'])}); "
                     "run the same command again to measure only those")
    lines += [f"{s['label']}: {s['note']}" for s in res["skipped"]]
    return lines


def recommendation_lines(res: dict) -> list[str]:
    a = res["advise"]
    if not a:
        return ["the advisor's cell has not run"]
    if not a["choice"]:
        return a["notes"]
    row = next(r for r in a["rows"] if r["name"] == a["choice"])
    eligible = sum(r["eligible"] for r in a["rows"])
    rec = a["recommendation"]
    return [f"choice: {a['choice']} (priority {a['priority']}: {a['rule']})",
            (f"measured: perplexity {row['delta_pct']:+.3f}% vs fp32 (limit {a['max_quality_loss']:g}%), peak KV "
            f"{row['kv_fraction']:.3f} of the fp32 full cache, decode speed {row['speed_ratio']:.2f}x fp32, "
            f"score {row['score']:.3f}, best of {eligible} candidates within the limit"),
            f"flags: {rec['cli_flags']}" if "cli_flags" in rec else f"engine options: {rec}",
            *a["notes"]]


def _quality_table(res: dict) -> str:
    panel = any("worst_text" in r for r in res["quality"])
    rows = [[r["label"], f"{r['kv_bytes_per_token']:.0f}", f"{r['kv_bytes_held_per_token']:.0f}", f"{r['ppl']:.4f}",
             f"{r.get('delta_pct', float('nan')):+.3f}",
             *([f"{r['mean_delta_pct']:+.3f}", r["worst_text"]] if panel else []),
             "yes" if r.get("pareto") else ""] for r in res["quality"]]
    worst = ["delta % (worst text)", "mean delta %", "worst text"] if panel else ["delta %"]
    return _table(["configuration", "format B/token", "KV held B/token", "ppl", *worst, "Pareto"], rows)


def _retrieval_table(res: dict) -> str:
    r = res["retrieval"]
    items = [(t, n) for t, by in r["rows"][0]["accuracy"].items() for n in by]
    rows = [[row["label"], *(f"{row['accuracy'][t][n]:.2f}" for t, n in items), f"{row['mean_accuracy']:.3f}",
             f"{row.get('kv_fraction', float('nan')):.3f}",
             "" if row.get("worst_solved_ratio") is None else f"{row['worst_solved_ratio']:.2f}"] for row in r["rows"]]
    return _table(["configuration", *(f"{t} @ {n}" for t, n in items), "mean", "KV at questions vs full",
                   "worst vs full (solved items)"], rows)


def _speed_table(res: dict) -> str:
    rows = [[k, f"{r['bytes_per_token']:.0f}", r["sequences_fit"], f"{r['capacity_ratio_vs_fp16']:.2f}",
             f"{r['decode_tok_s']:.1f}", f"{r['decode_tok_s'] / r['fp32_decode_tok_s']:.2f}x"]
            for k, r in res["speed"].items()]
    return _table(["format", "B/token", "seqs per budget", "capacity vs fp16", "decode tok/s", "speed vs fp32"], rows)


def spec_rows(res: dict) -> list[list]:
    """One row per workload x batch: plain vs ngram drafting decode speed, acceptance, same output."""
    r = res["speculative"] or {}
    return [[f"{workload}, batch {key[1:]}", f"{r['off'][workload][key]['decode_tok_s']:.1f}",
             f"{row['decode_tok_s']:.1f}", f"{row['speedup']:.2f}x", f"{row['acceptance_rate']:.2f}",
             f"{row['mean_acceptance_length']:.2f}", "yes" if row["same_output"] else "NO"]
            for workload, by_batch in r.get("ngram", {}).items() for key, row in by_batch.items()]


def render_html(res: dict, plots: list[Plot]) -> str:
    parts = [(f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvforge lab: {_esc(res['model'])}</title>"
             f"<style>{STYLE}</style></head><body>"),
             (f"<h1>kvforge lab</h1><p>model <code>{_esc(res['model'])}</code>, text {_esc(res['text'])} "
             f"({res['settings']['tokens']} tokens scored), mode {_esc(res['mode'])}, kvforge "
             f"{_esc(res['kvforge_version'])}</p>"),
             "".join(f"<p class='note'>{_esc(s)}</p>" for s in status_lines(res)),
             "<h2>Recommendation</h2>" + "".join(f"<p>{_esc(s)}</p>" for s in recommendation_lines(res))]
    parts += [f"<h2>{_esc(p.title)}</h2>{_image(p)}" for p in plots]
    if res["quality"]:
        parts.append("<h2>Quality and memory</h2>" + _quality_table(res))
    if res.get("retrieval"):
        parts.append("<h2>Retrieval (exact match, several questions after one context)</h2>" + _retrieval_table(res))
    if res["speed"]:
        parts.append("<h2>Formats: memory and speed</h2>" + _speed_table(res))
    if res["speculative"]:
        parts.append("<h2>Speculative decoding (ngram drafts, greedy)</h2>" + _table(
            ["workload", "plain tok/s", "ngram tok/s", "decode speedup", "acceptance", "mean accepted", "same output"],
            spec_rows(res)))
    commands = sorted({r["command"] for r in res["quality"]} | {r["command"] for r in res["speed"].values()}
                      | {r["command"] for r in (res.get("retrieval") or {}).get("rows", [])}
                      | set((res["passkey"] or {}).get("commands", []))
                      | {x["command"] for x in (res["long"], res["advise"], res["speculative"]) if x})
    parts.append("<h2>Reproduce</h2><details><summary>the single command behind every figure</summary><pre>"
                 + _esc("\n".join(commands)) + "</pre></details></body></html>")
    return "\n".join(parts)


def render_summary(res: dict) -> str:
    lines = [f"# kvforge lab: {res['model']}", "", (f"text {res['text']}, {res['settings']['tokens']} tokens scored, "
             f"mode {res['mode']}, kvforge {res['kvforge_version']}"), ""]
    lines += [f"- {s}" for s in status_lines(res)] + ["", "## Recommendation", ""]
    lines += [f"- {s}" for s in recommendation_lines(res)] + ["", "## Pareto set (KV held per token vs perplexity)", ""]
    front = sorted((r for r in res["quality"] if r.get("pareto")), key=lambda r: r["kv_bytes_held_per_token"])
    lines += [f"- {r['label']}: {r['kv_bytes_held_per_token']:.0f} B/token held, {r['delta_pct']:+.3f}% perplexity"
              for r in front] or ["- (the baseline cell has not run)"]
    if res["long"]:
        seg = res["long"]["segments"]
        lines += ["", (f"StreamingLLM over {res['long']['tokens']} tokens: segment perplexity {min(seg):.2f} .. "
                      f"{max(seg):.2f}, peak KV {max(res['long']['segment_peak_kv_bytes']) / 2**20:.1f} MiB")]
    for row in (res.get("retrieval") or {}).get("rows", []):
        lines += [f"- retrieval {row['label']}: mean accuracy {row['mean_accuracy']:.3f}"
                  + (f", KV at the questions {row['kv_fraction']:.3f} of the full cache's" if "kv_fraction" in row else "")]
    if res["passkey"]:
        g = res["passkey"]
        mean = [sum(map(sum, g[k])) / (len(g["lengths"]) * len(g["depths"])) for k in ("full", "with_policy")]
        lines += ["", f"passkey: mean accuracy {mean[0]:.2f} full cache, {mean[1]:.2f} {g['policy']}:{g['budget']}"]
    for row in spec_rows(res):
        what, plain, ngram, speedup, acceptance, _, same = row
        lines += ["", (f"speculative decoding, {what}: decode {plain} -> {ngram} tok/s ({speedup}), "
                      f"acceptance {acceptance}, same output: {same}")]
    lines += ["", "Figures, plots and the command behind each: results.json, report.html, plots/."]
    return "\n".join(lines) + "\n"
