from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from kvforge.errors import ModelLoadError
from kvforge.kv.spec import KVCacheSpec
from kvforge.models.hf_config import load_hf_config, model_config_from_hf

SMALL = {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 8}


def test_llama_mqa_with_llama3_rope_and_eos_list():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024}
    hf = transformers.LlamaConfig(
        **SMALL, num_key_value_heads=1, rope_theta=500000.0, rope_scaling=rope, max_position_embeddings=4096,
        rms_norm_eps=1e-5, bos_token_id=7, eos_token_id=[8, 9], tie_word_embeddings=True, attention_bias=True,
    ).to_dict()
    cfg = model_config_from_hf(hf)
    assert (cfg.arch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("llama", 8, 1, 32)
    assert cfg.attention_kind == "MQA"
    assert cfg.rope_theta == 500000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
    assert "rope_theta" not in cfg.rope_scaling
    assert cfg.max_position_embeddings == 4096 and cfg.tie_word_embeddings and cfg.attention_bias
    assert cfg.bos_token_id == 7 and cfg.eos_token_ids == [8, 9]
    assert not cfg.qk_norm and cfg.sliding_window is None and cfg.extra == {}


def test_llama_defaults_kv_heads_to_heads_and_head_dim_to_hidden_over_heads():
    hf = {**SMALL, "model_type": "llama", "eos_token_id": 2, "rope_theta": 10000.0}
    cfg = model_config_from_hf(hf)
    assert cfg.num_kv_heads == 8 and cfg.head_dim == 32 and cfg.attention_kind == "MHA"
    assert cfg.eos_token_ids == [2] and cfg.rope_scaling is None


def test_explicit_head_dim_wins():
    hf = transformers.LlamaConfig(**SMALL, num_key_value_heads=2, head_dim=64).to_dict()
    assert model_config_from_hf(hf).head_dim == 64


def test_mistral_is_llama_with_sliding_window():
    hf = transformers.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=4096).to_dict()
    cfg = model_config_from_hf(hf)
    assert cfg.arch == "llama" and cfg.sliding_window == 4096 and cfg.num_kv_heads == 2


def test_qwen2_has_qkv_bias_and_window_only_when_enabled():
    off = model_config_from_hf(transformers.Qwen2Config(**SMALL, num_key_value_heads=2, sliding_window=128).to_dict())
    assert off.arch == "qwen2" and off.attention_bias and off.sliding_window is None and not off.qk_norm
    on = transformers.Qwen2Config(
        **SMALL, num_key_value_heads=2, use_sliding_window=True, sliding_window=128, max_window_layers=1
    ).to_dict()
    assert model_config_from_hf(on).sliding_window == 128


def test_qwen3_has_qk_norm_and_explicit_head_dim():
    hf = transformers.Qwen3Config(**SMALL, num_key_value_heads=4, head_dim=64, rope_theta=1e6, eos_token_id=5)
    cfg = model_config_from_hf(hf.to_dict())
    assert cfg.arch == "qwen3" and cfg.qk_norm and not cfg.attention_bias
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta) == (64, 4, 1e6)


MLA = {"kv_lora_rank": 64, "q_lora_rank": 96, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 24}


def test_deepseek_v2_mla_and_moe_fields_go_to_extra():
    hf = transformers.DeepseekV2Config(
        **SMALL, **MLA, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, moe_intermediate_size=64,
        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=2, topk_group=1,
    ).to_dict()
    cfg = model_config_from_hf(hf)
    assert cfg.arch == "deepseek_v2" and cfg.attention_kind == "MLA"
    assert cfg.num_kv_heads == cfg.num_heads == 8 and cfg.head_dim == 32 + 16
    for k, v in MLA.items():
        assert cfg.extra[k] == v
    assert cfg.extra["n_routed_experts"] == 8 and cfg.extra["num_experts_per_tok"] == 2
    assert cfg.extra["first_k_dense_replace"] == 1 and cfg.extra["topk_method"] == "group_limited_greedy"
    assert cfg.kv_cache_spec() == KVCacheSpec(2, 1, 64 + 16, 0)


def test_deepseek_v3_yarn_rope_from_rope_parameters():
    yarn = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    hf = transformers.DeepseekV3Config(
        **SMALL, **MLA, rope_scaling=yarn, max_position_embeddings=163840, n_routed_experts=16,
        num_experts_per_tok=4, routed_scaling_factor=2.5, n_group=4, topk_group=2,
    ).to_dict()
    cfg = model_config_from_hf(hf)
    assert cfg.arch == "deepseek_v3" and cfg.head_dim == 48 and cfg.max_position_embeddings == 163840
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 40
    assert cfg.extra["routed_scaling_factor"] == 2.5 and cfg.extra["norm_topk_prob"] is True
    assert cfg.extra["kv_lora_rank"] == 64


def test_old_style_rope_scaling_key():
    hf = {**SMALL, "model_type": "llama", "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert model_config_from_hf(hf).rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}


def test_architectures_used_when_model_type_missing():
    hf = {**SMALL, "architectures": ["Qwen2ForCausalLM"]}
    assert model_config_from_hf(hf).arch == "qwen2"


def test_unsupported_model_type_names_supported_ones():
    with pytest.raises(ModelLoadError, match="gpt2.*supported model_type: deepseek_v2, deepseek_v3, gemma2, gemma3_text, llama"):
        model_config_from_hf({**SMALL, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_missing_keys_are_named():
    with pytest.raises(ModelLoadError, match="hidden_size"):
        model_config_from_hf({"model_type": "llama", "vocab_size": 10})


def test_load_from_dir_and_bad_paths(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(transformers.LlamaConfig(**SMALL).to_dict()))
    assert load_hf_config(tmp_path).num_layers == 2
    assert load_hf_config(tmp_path / "config.json").hidden_size == 256
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_hf_config(tmp_path / "missing")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="JSON"):
        load_hf_config(tmp_path / "bad.json")
