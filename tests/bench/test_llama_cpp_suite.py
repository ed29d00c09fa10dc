"""kvforge bench llama-cpp's pieces that need no timing: the bandwidth arithmetic (bytes a decode token reads, for
the GGUF as llama.cpp holds it and for kvforge's model), the thread counts, and the KV cache of exactly 8,192 fp16
tokens that the equal-capacity RSS comparison builds."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from kvforge.bench.bandwidth import bandwidth_fraction, gguf_bytes_per_token, model_bytes_per_token
from kvforge.bench.kv_rss import exact_kv_config, kvforge_process
from kvforge.bench.llama_cpp_suite import bandwidth_at_one_sequence, parse_threads
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.errors import ConfigError
from kvforge.models.loader import load_model


def test_bandwidth_share_is_bytes_per_token_times_tok_s_over_the_copy_bandwidth():
    r = bandwidth_fraction(96_000_000, 50.0, 8e9)
    assert r["read_bytes_per_s"] == 4.8e9 and r["fraction"] == pytest.approx(0.6)
    run = {"npl": [1, 8], "kvforge": {"weight_bytes_per_token": 1000, "b1": {"decode_tok_s": 20.0}},
           "llama_cpp": {"weight_bytes_per_token": 2000, "b1": {"decode_tok_s": 5.0}}}
    shares = bandwidth_at_one_sequence(run, 1e5)
    assert (shares["kvforge"]["fraction"], shares["llama_cpp"]["fraction"]) == (pytest.approx(0.2), pytest.approx(0.1))
    assert bandwidth_at_one_sequence({**run, "npl": [8]}, 1e5) == {}


def test_a_tied_gguf_reads_every_tensor_an_untied_one_all_but_its_embedding(smol_path, tmp_path):
    every = sum(int(t.n_bytes) for t in GGUFReader(smol_path).tensors)
    assert gguf_bytes_per_token(smol_path) == every  # no output.weight: the table is the LM head
    w = GGUFWriter(str(tmp_path / "untied.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((64, 32), np.float32))
    w.add_tensor("output.weight", np.zeros((64, 32), np.float16))
    w.add_tensor("output_norm.weight", np.zeros(32, np.float32))
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        write()
    w.close()
    assert gguf_bytes_per_token(tmp_path / "untied.gguf") == 64 * 32 * 2 + 32 * 4


def test_kvforge_reads_the_files_blocks_per_token_and_no_panel_copy(smol_path, tiny_loaded):
    auto = load_model(smol_path, weights="auto")
    inv_freq = auto.model.rotary.inv_freq.nbytes
    assert model_bytes_per_token(auto.model) == gguf_bytes_per_token(smol_path) + inv_freq
    engine = LLMEngine(EngineConfig(kv_cache_memory="4MiB", weights="fp32"), tiny_loaded)  # panels made
    model = engine.loaded.model
    head, table = model.lm_head.weight, model.model.embed_tokens.weight
    assert head is not table
    # fused q/k/v and gate/up: their parts are views, one storage each
    weights = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in model.parameters() if p is not table}
    read = sum(weights.values()) + model.rotary.inv_freq.nbytes
    assert model_bytes_per_token(model) == read < engine.weight_bytes - table.nbytes


def test_thread_counts_as_people_type_them():
    assert parse_threads(["1,2"]) == parse_threads(["1", "2"]) == [1, 2]
    for bad in (["0"], ["two"], [","]):
        with pytest.raises(ConfigError, match="--threads"):
            parse_threads(bad)


def _f16_bytes(cfg, tokens: int) -> int:
    """llama.cpp's f16 cache of n_ctx tokens: K and V of every layer, kv heads x head_dim, 2 bytes each."""
    return tokens * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2


@pytest.mark.parametrize("package", ["smollm2", "gemma3-270m"])
def test_the_equal_capacity_cache_holds_exactly_8192_fp16_tokens_in_every_layer(package, smol_path):
    from kvforge.models.packaged import packaged_model_path

    path = smol_path if package == "smollm2" else packaged_model_path("gemma3-270m")
    r = kvforge_process(path, 8192, 1, "auto", npp=8, ntg=2)
    cfg = load_model(path, weights="auto").config
    assert r["kv_tokens"] == 8192 and r["kv_bytes"] == _f16_bytes(cfg, 8192)
    assert r["weights"] == "auto:gguf_blocks"


def test_exact_kv_sizing_leaves_nothing_over_and_refuses_a_partial_block(tiny_loaded):
    config = exact_kv_config(tiny_loaded.config, 256, "fp32")
    engine = LLMEngine(config, tiny_loaded)
    split = engine.kv_budget_split()
    assert engine.kv.allocator.num_blocks * 16 == 256 and engine.max_model_len == 256
    assert split["kv_other_bytes"] == split["kv_staging_bytes"] == 0
    assert split["kv_block_bytes_total"] == _f16_bytes(tiny_loaded.config, 256) == config.kv_cache_memory
    with pytest.raises(ConfigError, match="multiple of the block size 16"):
        exact_kv_config(tiny_loaded.config, 100)


def test_one_command_runs_every_thread_count_with_its_bandwidth_share(tiny_dir, capsys):
    import json

    from kvforge.cli import main

    assert main(["bench", "llama-cpp", "--kvforge-only", "--model", tiny_dir, "--threads", "1,2", "--npp", "4",
                 "--ntg", "2", "--npl", "1", "2", "--rounds", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["threads"] == [1, 2] and set(r["runs"]) == set(r["bandwidth_b1"]) == {"1", "2"}
    for t in ("1", "2"):
        run, bw = r["runs"][t], r["bandwidth_b1"][t]
        assert run["threads"] == int(t) and "llama_cpp" not in run and "llama_cpp" not in bw
        assert bw["kvforge"]["fraction"] == pytest.approx(
            run["kvforge"]["weight_bytes_per_token"] * run["kvforge"]["b1"]["decode_tok_s"] / bw["copy_bytes_per_s"])
    assert "rss_equal_kv" not in r  # no GGUF for both engines, no llama.cpp
