"""The evaluation panel: real texts of five kinds, variants parsed from one string, the baseline scored once."""
import json
from types import SimpleNamespace

import pytest

from kvforge.errors import ConfigError
from kvforge.eval import panel
from kvforge.eval.panel import BASELINE, panel_eval, parse_variant
from kvforge.eval.texts import HELD_OUT, PANEL, code_comments, load_text


def test_panel_texts_are_long_distinct_and_of_five_kinds(smol_loaded):
    assert len(set(PANEL.values())) == len(PANEL) >= 5 and HELD_OUT not in PANEL
    heads = set()
    for name in [*PANEL, HELD_OUT]:
        text = load_text(name)
        assert len(smol_loaded.tokenizer.encode(text)) >= 4096, name
        heads.add(text[:2000])
    assert len(heads) == len(PANEL) + 1
    assert "GNU GENERAL PUBLIC LICENSE" in load_text("gpl-3")
    assert "FALSTAFF" in load_text("merry-wives") and "**" not in load_text("merry-wives")


def test_code_comments_keep_comments_and_docstrings_only():
    source = 'def f(x):\n    """Double x."""\n    # the answer\n    return x * 2  # twice\ns = "not a comment"\n'
    assert code_comments(source).splitlines() == ["Double x.", "the answer", "twice"]


def test_parse_variant_names_format_policy_and_options():
    v = parse_variant('int4:{"group_size": 32}+h2o:0.5:{"recent": 0.9}')
    assert v.options == {"kv_cache_dtype": "int4", "kv_cache_options": {"group_size": 32}, "kv_policy": "h2o",
                         "kv_policy_options": {"recent": 0.9, "budget": 0.5}}
    assert parse_variant("fp32+streaming:1024").options["kv_policy_options"] == {"budget": 1024}
    assert parse_variant("int8").options == {"kv_cache_dtype": "int8", "kv_cache_options": None}
    with pytest.raises(ConfigError, match="needs a budget"):
        parse_variant("int8+h2o")


def test_baseline_once_per_text_and_rows_resume(tiny_loaded, tmp_path, monkeypatch):
    calls = []
    real = panel.perplexity

    def counting(engine, ids, *a, **k):
        calls.append(engine.format.name)
        return real(engine, ids, *a, **k)

    monkeypatch.setattr(panel, "perplexity", counting)
    monkeypatch.setattr(tiny_loaded, "tokenizer", SimpleNamespace(encode=lambda text: [ord(c) % 64 for c in text[:400]],
                                                                   decode=lambda ids: ""))
    variants = [parse_variant("int8"), parse_variant("fp16")]
    rows_file = str(tmp_path / "rows.jsonl")
    r = panel_eval(tiny_loaded, variants, ["gpl-3", "apache-2.0"], max_tokens=48, rows_file=rows_file)
    assert calls == ["fp32", "int8", "fp16"] * 2
    assert set(r["variants"]) == {"int8", "fp16"}
    fp16 = r["variants"]["fp16"]
    assert set(fp16["deltas"]) == {"gpl-3", "apache-2.0"}
    assert fp16["worst_pct"] == max(fp16["deltas"].values())
    assert fp16["mean_pct"] == pytest.approx(sum(fp16["deltas"].values()) / 2)
    with open(rows_file) as f:
        assert [json.loads(line)["variant"] for line in f] == [BASELINE, "int8", "fp16"] * 2
    calls.clear()
    again = panel_eval(tiny_loaded, [*variants, parse_variant("bf16")], ["gpl-3", "apache-2.0"], 48, rows_file)
    assert calls == ["bf16", "bf16"]  # the baselines and the scored variants are read back
    assert again["variants"]["int8"] == r["variants"]["int8"]
