"""Evals say what they run, show progress, bound their agreement work by --max-tokens, and label columns."""
from __future__ import annotations

from kvforge.eval.passkey import format_passkey, technique_label
from kvforge.eval.ppl import agreement_prompt_count, ppl_eval
from kvforge.eval.texts import load_text
from kvforge.progress import Progress


def test_agreement_prompts_are_bounded_by_the_scored_tokens():
    assert agreement_prompt_count(12, 4096) == 12  # the documented 4k runs keep all 12
    assert agreement_prompt_count(12, 512) == 3
    assert agreement_prompt_count(12, 100) == 0
    assert agreement_prompt_count(0, 4096) == 0


def test_ppl_eval_logs_its_plan_shows_bars_and_runs_the_bounded_agreement(smol_loaded, capsys):
    said = []
    r = ppl_eval(smol_loaded, load_text("hamlet", None), max_tokens=160, agreement_prompts=12, agreement_tokens=16, progress=True,
                 log=said.append, kv_cache_dtype="int8")
    assert r["tokens"] == 160 and r["greedy"]["prompts"] == 1
    assert said == [("scoring 160 tokens with the fp32 full cache, then with the technique; then 1 greedy agreement "
                     "prompts x 16 tokens on both")]
    err = capsys.readouterr().err
    for label in ("perplexity, fp32 baseline", "perplexity, technique", "greedy agreement, baseline"):
        assert f"{label}: [{'#' * 24}]" in err  # each bar reached its end


def test_progress_bar_counts_and_fills():
    p = Progress("x", 8, enabled=False)
    p.update(2)
    assert p.line().startswith("x: [######" + "." * 18 + "] 2/8 (")


def test_passkey_columns_name_baseline_and_technique():
    acc = {"0.5": 1.0}
    r = {"length": 256, "trials": 1, "full": {"accuracy": acc, "mean": 1.0, "peak_kv_bytes": 2**20},
         "policy": {"accuracy": {"0.5": 0.0}, "mean": 0.0, "peak_kv_bytes": 2**19}}
    header = format_passkey(r, technique_label("fp32", "h2o", 512)).splitlines()[1].split()
    assert header == ["depth", "baseline", "(fp32", "full)", "fp32", "h2o", "512"]
    assert technique_label("int8", None, None) == "int8 full"
