"""kvforge bench weights: both weight kinds run in every round, and the ratios are the medians' and each round's."""
import pytest

from kvforge.bench.weights import weights_bench
from kvforge.cli import main
from kvforge.errors import ConfigError


def test_both_kinds_run_every_round_and_ratios_follow_the_medians(tiny_loaded):
    r = weights_bench(tiny_loaded, npp=8, ntg=3, npl=(1, 3), rounds=3)
    assert r["kinds"] == ["fp32", "int8"] and r["npl"] == [1, 3]
    for key, pl in (("b1", 1), ("b3", 3)):
        fp32, int8 = r["fp32"][key], r["int8"][key]
        assert fp32["rounds"] == int8["rounds"] == 3
        assert int8["decode_tok_s"] * int8["decode_s"] == pytest.approx(pl * 3)
        assert r["ratio"][f"decode_{key}"] == pytest.approx(int8["decode_tok_s"] / fp32["decode_tok_s"])
        assert r["ratio_cpu"][f"decode_{key}"] == pytest.approx(int8["decode_tok_per_cpu_s"] / fp32["decode_tok_per_cpu_s"])
    with pytest.raises(ConfigError, match="two weight kinds"):
        weights_bench(tiny_loaded, kinds=("int8",))


def test_eval_ppl_refuses_int8_weights_with_the_panel(capsys):
    assert main(["eval", "ppl", "--panel", "--weights", "int8"]) == 2
    assert "--weights int8 scores one text" in capsys.readouterr().err


def test_q4_0_against_fp32_reports_bytes_held_and_the_perplexity_delta(smol_loaded):
    r = weights_bench(smol_loaded, kinds=("fp32", "q4_0"), npp=8, ntg=2, npl=(1,), rounds=1, ppl_tokens=64)
    held = r["weight_bytes"]
    assert held["q4_0"] < held["fp32"] / 4 and r["weight_bytes_ratio"] == held["q4_0"] / held["fp32"]
    p = r["perplexity"]
    assert p["tokens"] == 64 and p["text"] == "hamlet" and p["ppl"]["q4_0"] != p["ppl"]["fp32"]
    assert p["delta_pct"] == pytest.approx(100 * (p["ppl"]["q4_0"] / p["ppl"]["fp32"] - 1))
    assert abs(p["delta_pct"]) < 50
