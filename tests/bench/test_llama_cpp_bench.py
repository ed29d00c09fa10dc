"""kvforge bench llama-cpp: the kvforge side and the JSON shape without llama.cpp, the install hint when the
extra is missing, the F32 GGUF copy, and (only where llama-cpp-python is installed) both engines."""
from __future__ import annotations

import sys

import pytest
import torch

from kvforge.bench.llama_cpp import llama_cpp_bench
from kvforge.cli import main
from kvforge.errors import ConfigError


def test_kvforge_side_counts_every_prompt_and_decode_token(tiny_loaded):
    r = llama_cpp_bench(tiny_loaded, npp=8, ntg=3, npl=(1, 3), threads=1, kvforge_only=True, rounds=2)
    assert (r["npp"], r["ntg"], r["npl"], r["threads"], r["rounds"]) == (8, 3, [1, 3], 1, 2)
    assert "llama_cpp" not in r and "ratio" not in r
    for pl in (1, 3):
        row = r["kvforge"][f"b{pl}"]
        assert row["prefill_tok_s"] * row["prefill_s"] == pytest.approx(pl * 8)
        assert row["decode_tok_s"] * row["decode_s"] == pytest.approx(pl * 3)
        assert row["decode_tok_per_cpu_s"] * row["decode_cpu_s"] == pytest.approx(pl * 3)
        assert row["rounds"] == 2 and 0 < row["decode_cpu_s"]
    total = r["kvforge"]["prefill_tok_s"] * (r["kvforge"]["b1"]["prefill_s"] + r["kvforge"]["b3"]["prefill_s"])
    assert total == pytest.approx(4 * 8)


def test_bad_shapes_are_refused(tiny_loaded):
    with pytest.raises(ConfigError, match="--npl"):
        llama_cpp_bench(tiny_loaded, npp=8, ntg=3, npl=(0,), kvforge_only=True)
    with pytest.raises(ConfigError, match="rounds=0"):
        llama_cpp_bench(tiny_loaded, npp=8, ntg=3, npl=(1,), kvforge_only=True, rounds=0)


def test_without_the_extra_the_command_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError, installed or not
    assert main(["bench", "llama-cpp", "--npp", "4", "--ntg", "2", "--npl", "1"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'kvforge[llamacpp]'" in err and "--kvforge-only" in err


@pytest.mark.slow
def test_f32_gguf_holds_the_weights_kvforge_loads(smol_path, smol_loaded, tmp_path):
    from kvforge.bench.gguf_f32 import write_f32_gguf
    from kvforge.models.gguf_loader import load_gguf

    path = write_f32_gguf(smol_path, tmp_path / "smol.F32.gguf")
    cfg, weights, _ = load_gguf(path)
    assert cfg == smol_loaded.config
    state = smol_loaded.model.state_dict()
    assert set(weights) == set(state) - {"lm_head.weight"}  # tied to the embedding
    for name, w in weights.items():
        assert w.dtype == torch.float32 and torch.equal(w, state[name]), name


@pytest.mark.slow
def test_both_engines_side_by_side(smol_loaded, tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the kvforge[llamacpp] extra) is not installed")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    r = llama_cpp_bench(smol_loaded, npp=16, ntg=4, npl=(1, 2), threads=1, rounds=1)
    assert set(r["ratio"]) == set(r["ratio_cpu"]) == {"decode_b1", "decode_b2", "prefill"}
    for pl in (1, 2):
        theirs = r["llama_cpp"][f"b{pl}"]
        assert theirs["decode_tok_s"] * theirs["decode_s"] == pytest.approx(pl * 4)
        assert r["ratio"][f"decode_b{pl}"] == pytest.approx(r["kvforge"][f"b{pl}"]["decode_tok_s"] / theirs["decode_tok_s"])
    assert r["llama_cpp"]["gguf"].endswith(".F32.gguf")
