"""`kvforge serve`: a busy port fails before the model loads; the start-up log names model, KV pool and limits."""
from __future__ import annotations

import socket

import pytest
from reuse_model import reuse_loaded_smollm2  # noqa: F401  (autouse fixture)

from kvforge.cli import main
from kvforge.cli.serve import startup_lines
from kvforge.config import EngineConfig
from kvforge.engine import weights_mode
from kvforge.engine.engine import LLMEngine


def test_busy_port_is_reported_before_the_model_loads(capsys, monkeypatch):
    def must_not_load(*a, **k):
        raise AssertionError("the model was loaded although the port is busy")

    monkeypatch.setattr(weights_mode, "load_model", must_not_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err


def test_positional_model_and_model_option_must_agree(capsys):
    assert main(["serve", "a.gguf", "--model", "b.gguf"]) == 2
    assert "two models given" in capsys.readouterr().err


def test_startup_log_names_model_pool_format_and_max_model_len(smol_loaded):
    engine = LLMEngine(EngineConfig(kv_cache_memory="32MiB", kv_cache_dtype="int8", max_model_len=1024), smol_loaded)
    text = "\n".join(startup_lines(engine, "smol", "http://127.0.0.1:8000"))
    s = engine.stats()
    assert "smol" in text and smol_loaded.path in text
    assert "max_model_len 1,024" in text
    assert f"int8 ({engine.kv.block_bytes / engine.kv.block_size:,.0f} bytes/token)" in text
    assert f"{s['kv_blocks_total']:,} blocks of 16 tokens" in text
    assert "http://127.0.0.1:8000/v1" in text
    assert "chat template: the model's own; requests without sampling fields get temperature 0.2, top_p 0.9 (the " \
           "SmolLM2-135M-Instruct model card" in text
    assert "KV budget 32.0 MiB: blocks " in text and "structured output (response_format json_object / json_schema, " \
           "tools): on, llguidance " in text


@pytest.mark.parametrize("options, message", [
    ({"max_model_len": 100_000}, "max_model_len=100000 is more than the model's context of 8192 tokens"),
    ({"kv_cache_memory": "12 parsecs"}, "bad size"),
])
def test_engine_config_refusals_name_the_numbers(smol_loaded, options, message):
    from kvforge.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        LLMEngine(EngineConfig(**{"kv_cache_memory": "64MiB", **options}), smol_loaded)


def test_sizes_as_strings_and_streaming_beyond_the_context():
    from kvforge.config import check_max_model_len
    from kvforge.errors import ConfigError
    from kvforge.kv.policies import build_policy

    assert EngineConfig(kv_cache_memory="512MiB").kv_cache_memory == 512 << 20
    check_max_model_len(16384, 8192, build_policy("streaming", {"budget": 256}))  # positions stay bounded
    with pytest.raises(ConfigError, match="16384 is more than the model's context of 8192"):
        check_max_model_len(16384, 8192, build_policy("h2o", {"budget": 256}))


def test_llm_takes_vllm_keyword_names_and_size_strings(smol_loaded):
    from kvforge.llm import LLM

    llm = LLM(kv_cache_memory="32MiB", max_model_len=512)
    assert llm.engine.config.kv_cache_memory == 32 << 20
    assert llm.engine.kv.stats()["kv_bytes_total"] <= 32 << 20
    llm = LLM(gpu_memory_utilization=0.01, max_model_len=512)
    assert llm.engine.config.kv_cache_memory_fraction == 0.01 and llm.engine.config.kv_cache_memory is None
