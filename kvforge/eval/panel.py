"""Perplexity on a panel of texts: the fp32 full cache once per text, then every variant against it, in one process.

A variant is a format and a policy, written `FORMAT[:OPTIONS][+POLICY:BUDGET[:OPTIONS]]`, e.g.
`int4:{"group_size": 32}` or `int8+h2o:0.5:{"recent": 0.5}`. Rows can stream into a JSON-lines file,
which a rerun reads back so an interrupted sweep resumes where it stopped.
"""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

from kvforge.errors import ConfigError
from kvforge.eval.ppl import engine_for, perplexity
from kvforge.eval.texts import PANEL, load_text
from kvforge.kv.formats import parse_format_spec
from kvforge.kv.memory import bytes_per_token
from kvforge.options import json_object

BASELINE = "fp32 (baseline)"


@dataclass(frozen=True)
class Variant:
    label: str
    options: dict  # engine keyword arguments (kv_cache_dtype, kv_cache_options, kv_policy, kv_policy_options)


def parse_variant(text: str) -> Variant:
    """'int4:{"group_size": 32}+streaming:1024' -> the engine options it names."""
    fmt, _, policy = text.partition("+")
    name, fmt_options = parse_format_spec(fmt)
    options: dict = {"kv_cache_dtype": name, "kv_cache_options": fmt_options or None}
    if policy:
        pname, _, rest = policy.partition(":")
        budget_text, _, raw = rest.partition(":")
        try:
            budget = float(budget_text)
        except ValueError:
            raise ConfigError(f"variant {text!r}: a policy needs a budget, e.g. h2o:0.5 or streaming:1024") from None
        pol = json_object(f"variant {text!r}: the policy options", raw, '{"recent": 0.5}')
        pol["budget"] = int(budget) if budget >= 1 else budget
        options.update(kv_policy=pname, kv_policy_options=pol)
    return Variant(text, options)


def summarize(rows: list[dict]) -> dict[str, dict]:
    """Per variant: each text's delta (%), the worst text and the mean."""
    out: dict[str, dict] = {}
    for r in rows:
        if r["variant"] == BASELINE:
            continue
        v = out.setdefault(r["variant"], {"deltas": {}, "kv_bytes_per_token": r["kv_bytes_per_token"]})
        v["deltas"][r["text"]] = r["delta_pct"]
    for v in out.values():
        worst = max(v["deltas"], key=v["deltas"].get)
        v.update(worst_text=worst, worst_pct=v["deltas"][worst], mean_pct=sum(v["deltas"].values()) / len(v["deltas"]))
    return out


def _read_rows(path: str | None) -> list[dict]:
    if not path or not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def panel_eval(loaded, variants: list[Variant], texts: list[str] | None = None, max_tokens: int = 4096,
               rows_file: str | None = None, log: Callable[[str], None] | None = None) -> dict:
    """Score every variant on every text against that text's fp32 full cache (scored once per text)."""
    texts = texts or list(PANEL)
    rows = [r for r in _read_rows(rows_file) if r["tokens_requested"] == max_tokens]
    done = {(r["text"], r["variant"]): r for r in rows}
    with open(rows_file, "a", encoding="utf-8") if rows_file else contextlib.nullcontext() as sink:
        for name in texts:
            todo = [v for v in variants if (name, v.label) not in done]
            if not todo:
                continue
            ids = loaded.tokenizer.encode(load_text(name))[:max_tokens]
            base = done.get((name, BASELINE))
            if base is None:
                r, bpt = _score(loaded, ids, {})
                base = _row(name, BASELINE, r, r["ppl"], max_tokens, bpt)
                _emit(base, rows, sink, log)
            for v in todo:
                r, bpt = _score(loaded, ids, v.options)
                _emit(_row(name, v.label, r, base["ppl"], max_tokens, bpt), rows, sink, log)
    wanted = {v.label for v in variants} | {BASELINE}
    rows = [r for r in rows if r["text"] in texts and r["variant"] in wanted]
    return {"texts": texts, "tokens": max_tokens, "rows": rows, "variants": summarize(rows)}


def _score(loaded, ids: list[int], options: dict) -> tuple[dict, float]:
    engine = engine_for(loaded, len(ids), **options)
    return perplexity(engine, ids), bytes_per_token(engine.kv_spec, engine.format, engine.kv.block_size)


def _row(text: str, variant: str, r: dict, base_ppl: float, requested: int, bpt: float) -> dict:
    return {"text": text, "variant": variant, "ppl": r["ppl"], "ppl_baseline": base_ppl,
            "delta_pct": 100.0 * (r["ppl"] - base_ppl) / base_ppl, "tokens": r["tokens"], "tokens_requested": requested,
            "peak_kv_bytes": r["peak_kv_bytes"], "kv_bytes_per_token": bpt, "seconds": r["seconds"]}


def _emit(row: dict, rows: list[dict], sink, log) -> None:
    rows.append(row)
    if sink:
        sink.write(json.dumps(row) + "\n")
        sink.flush()
    if log:
        log(f"{row['text']:<18} {row['variant']:<40} ppl {row['ppl']:.4f}  delta {row['delta_pct']:+.2f}%  "
            f"({row['seconds']:.0f} s)")
