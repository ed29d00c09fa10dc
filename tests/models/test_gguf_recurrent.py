"""GGUF files of LFM2, Mamba-2 and Granite 4.0-H, written as llama.cpp's converter writes them (tests/gguf_convert.py),
load into the same model as their Hugging Face directory: F32 logits equal, Q8_0 / Q4_0 linears kept in their blocks
(weights="auto") compute as the dequantized fp32 load; transformers' own GGUF loading of LFM2 agrees; RWKV GGUFs are
refused with the reason; `kvforge memory FILE.gguf` counts KV per token and state per sequence."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_convert import convert, rwkv6_stub
from tiny_models import hf_config, tiny_maker

from kvforge import LLM, SamplingParams
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.scoring import position_logits
from kvforge.errors import ModelLoadError
from kvforge.memcalc import memory_report
from kvforge.models.loader import load_model
from kvforge.models.quant_weights import QBlockLinear, holds_blocks
from kvforge.models.weight_store import planned_bytes

KINDS = ["lfm2", "mamba2", "granite-hybrid-nope", "granite-hybrid"]
TOKENS = torch.randint(0, 96, (80,), generator=torch.Generator().manual_seed(1)).tolist()
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_maker(tmp_path_factory)


def _engine(path, weights: str = "fp32") -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory=4 << 20, block_size=16, max_num_seqs=4, weights=weights),
                     load_model(str(path), weights=weights))


@pytest.mark.parametrize("kind", KINDS)
def test_f32_gguf_gives_the_hf_directorys_logits_and_tokens(kind, tiny):
    directory, hf = tiny(kind)
    path = convert(directory, directory / "f32.gguf")
    ours, theirs = _engine(path), _engine(directory)
    assert ours.model_config.state_groups == theirs.model_config.state_groups
    assert ours.model_config.attention_layers == theirs.model_config.attention_layers
    with torch.no_grad():
        ref = hf(torch.tensor([TOKENS])).logits[0]
    for chunk in (len(TOKENS), 7):
        torch.testing.assert_close(position_logits(ours, TOKENS, chunk_size=chunk), ref, atol=1e-4, rtol=1e-4)
    prompts = [TOKENS[:40], TOKENS[20:31]]
    outs = [o.outputs[0].token_ids for o in LLM.from_engine(ours).generate(prompts, GREEDY)]
    assert outs == [o.outputs[0].token_ids for o in LLM.from_engine(theirs).generate(prompts, GREEDY)]


@pytest.mark.parametrize("kind,qtype", [("lfm2", Q.Q8_0), ("mamba2", Q.Q4_0), ("granite-hybrid-nope", Q.Q8_0),
                                        ("granite-hybrid", Q.Q4_0)])
def test_block_weights_compute_as_the_dequantized_fp32_load(kind, qtype, tiny):
    directory, _ = tiny(kind)
    path = convert(directory, directory / f"{qtype.name}.gguf", qtype)
    blocks, fp32 = _engine(path, "auto"), _engine(path, "fp32")
    assert blocks.weights_mode == "auto:gguf_blocks" and not holds_blocks(fp32.loaded.model)
    in_blocks = [n for n, m in blocks.loaded.model.named_modules() if isinstance(m, QBlockLinear)]
    assert any(("in_proj" in n) for n in in_blocks) and any("out_proj" in n for n in in_blocks), in_blocks
    if kind.startswith("granite"):  # the shared MLP's gate and up parts fused again, as blocks
        assert "model.layers.0.shared_mlp.input_linear" in in_blocks
    assert blocks.weight_bytes == planned_bytes(blocks.model_config, "auto", str(path))
    assert blocks.weight_bytes < 0.8 * fp32.weight_bytes
    state, want = blocks.loaded.model.state_dict(), fp32.loaded.model.state_dict()
    assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
    # a whole-prompt step (more rows than the integer kernel takes): dequantized tiles, fp32 activations
    torch.testing.assert_close(position_logits(blocks, TOKENS, chunk_size=len(TOKENS)),
                               position_logits(fp32, TOKENS, chunk_size=len(TOKENS)), atol=1e-4, rtol=1e-4)
    # decode rows round activations to int8 per block (llama.cpp's Q8_0 activations): the first tokens agree
    prompts = [TOKENS[:40], TOKENS[5:60], TOKENS[20:31]]
    ours = [o.outputs[0].token_ids for o in LLM.from_engine(blocks).generate(prompts, GREEDY)]
    ref = [o.outputs[0].token_ids for o in LLM.from_engine(fp32).generate(prompts, GREEDY)]
    assert [o[:2] for o in ours] == [r[:2] for r in ref], (ours, ref)


def test_transformers_loads_the_same_lfm2_gguf(tmp_path):
    """transformers.integrations.ggml reads LFM2 GGUFs (no conv biases, as the released models)."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config("lfm2")
    cfg.conv_bias = False
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(tmp_path)
    path = convert(tmp_path, tmp_path / "lfm2.gguf", Q.Q8_0)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name).eval()
    with torch.no_grad():
        ref = theirs(torch.tensor([TOKENS])).logits[0]
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(position_logits(_engine(path), TOKENS, chunk_size=16), ref, atol=1e-4, rtol=1e-4)


def test_rwkv_gguf_is_refused_with_the_reason(tmp_path):
    path = rwkv6_stub(tmp_path / "rwkv6.gguf")
    for load in (lambda: load_model(str(path)), lambda: memory_report(str(path))):
        with pytest.raises(ModelLoadError, match=r"RWKV-6.*RwkvForCausalLM is RWKV-4.*Hugging Face directory"):
            load()


@pytest.mark.parametrize("kind", ["lfm2", "granite-hybrid-nope", "mamba2"])
def test_memory_of_a_gguf_shows_kv_per_token_and_state_per_sequence(kind, tiny):
    directory, _ = tiny(kind)
    path = convert(directory, directory / "f32.gguf")
    ours = memory_report(str(path), seq_len=64, kv_dtype="fp32")
    theirs = memory_report(str(directory), seq_len=64, kv_dtype="fp32")
    engine = _engine(path)
    assert ours.state_bytes_per_sequence == engine.state_bytes > 0
    assert ours.recurrent_layers == theirs.recurrent_layers == sum(len(g.layers) for g in engine.state_groups)
    assert ours.per_token_bytes == theirs.per_token_bytes
    assert (ours.per_token_bytes > 0) == (kind != "mamba2")
