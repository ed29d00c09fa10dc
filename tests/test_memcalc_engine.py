"""kvforge memory and the engine agree: its defaults are what the engine runs, its weight bytes what the engine
holds (models/weight_store.py)."""
from __future__ import annotations

import json

import pytest
from test_memcalc import HAND_ELEMENTS, MiB

from kvforge.cli import main
from kvforge.errors import ConfigError
from kvforge.memcalc import engine_weight_bytes, memory_report, resolve_model
from kvforge.presets import get_preset


def test_cli_defaults_are_what_the_engine_would_run(capsys):
    """`kvforge memory MODEL` sizes the engine's KV format and the weight bytes the engine would hold, and says so in
    --help; other engines' deployments are modelled with flags."""
    from kvforge.config import EngineConfig
    from kvforge.presets import get_preset

    engine = EngineConfig()
    assert main(["memory", "smollm2-135m", "--seq-len", "4096", "--memory", "4GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_dtype"] == engine.kv_cache_dtype == "fp32"
    assert out["per_token_bytes"] == HAND_ELEMENTS["smollm2-135m"] * 4
    assert out["fits"]["weights_bytes"] == engine_weight_bytes(get_preset("smollm2-135m"), engine.weights)
    assert f"weights={engine.weights}, its default" in out["fits"]["weights_source"]
    assert main(["memory", "smollm2-135m", "--memory", "4GiB", "--kv-dtype", "fp16", "--weights-dtype", "fp16",
                 "--json"]) == 0
    vllm = json.loads(capsys.readouterr().out)
    assert vllm["per_token_bytes"] == HAND_ELEMENTS["smollm2-135m"] * 2
    assert vllm["fits"]["weights_source"] == "0.13B parameters at fp16"
    with pytest.raises(SystemExit):
        main(["memory", "--help"])
    assert "Defaults are what kvforge's engine would run" in " ".join(capsys.readouterr().out.split())


def test_engine_weights_are_the_bytes_the_engine_holds_for_any_model_it_runs():
    from kvforge.models.weight_store import planned_bytes

    cfg = get_preset("smollm2-135m")
    for mode in ("fp32", "int8"):
        r = memory_report(resolve_model("smollm2-135m"), memory=4 * 1024 * MiB, engine_weights=mode)
        assert r.fits.weights_bytes == planned_bytes(cfg, mode) and f"weights={mode}" in r.fits.weights_source
    with pytest.raises(ConfigError, match="engine weights must be one of"):
        memory_report(resolve_model("smollm2-135m"), memory=MiB, engine_weights="int4")


@pytest.mark.parametrize("package", ["smollm2", "gemma3-270m"])
def test_memory_of_a_packaged_gguf_counts_the_bytes_its_engine_holds(package, smol_path, capsys):
    """One reader of a GGUF's config (models/gguf_loader.read_gguf_config): `kvforge memory FILE.gguf` builds the
    model the engine loads (Gemma 3's QK-norm and local RoPE base included), so their weight bytes are equal."""
    from kvforge.config import EngineConfig
    from kvforge.engine.engine import LLMEngine
    from kvforge.models.loader import load_model
    from kvforge.models.packaged import packaged_model_path

    path = smol_path if package == "smollm2" else packaged_model_path("gemma3-270m")
    loaded = load_model(path, weights="auto")
    assert resolve_model(path).config == loaded.config
    assert main(["memory", path, "--memory", "4GiB", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["fits"]["weights_bytes"]
    engine = LLMEngine(EngineConfig(kv_cache_memory="4MiB"), loaded)  # weights auto, the default
    assert shown == engine.weight_bytes
