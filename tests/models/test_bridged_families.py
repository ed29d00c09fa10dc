"""Families beyond the plain Llama shape through the layer bridge (models/bridged.py): Qwen3 (q/k head norms),
Gemma 2 (output norms, (1 + w) weights, GELU-tanh, attention soft-cap) and Gemma 3 (and head norms, two RoPE
bases). Steps of a few rows (streamed weights) and of many (panels) give the per-op forward's tokens and
transformers'."""
from __future__ import annotations

import pytest
import torch
from bridge_runs import run_tokens
from hf_reference import hf_greedy
from tiny_models import write_tiny_model

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.models import bridged
from kvforge.models.loader import load_model
from kvforge.ops.layer_bridge import BRIDGE_ROWS, serves
from kvforge.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
FEW = [[(5 * i + j) % 90 + 3 for j in range(4 + 7 * i)] for i in range(3)]
MANY = [[(3 * i + j) % 90 + 3 for j in range(3 + 2 * i)] for i in range(12)]
ACTIVATION = {"qwen3": "silu", "gemma2": "gelu_tanh", "gemma3": "gelu_tanh"}


@pytest.fixture(scope="module", autouse=True)
def compiled():
    if not serves(torch.zeros(1, 8)):
        pytest.skip("no compiled layer bridge on this machine (no compiler or no AVX-512)")


@pytest.fixture(scope="module", params=list(ACTIVATION))
def family(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf = write_tiny_model(request.param, d)
    return request.param, hf, load_model(str(d))


def _generate(loaded, prompts, speculative=None, kv_dtype="fp32"):
    return run_tokens(loaded, prompts, GREEDY, speculative, kv_dtype)


@pytest.mark.parametrize("prompts,speculative", [(FEW, None), (MANY, None),
                                                 (FEW, {"method": "ngram", "num_speculative_tokens": 3,
                                                        "prompt_lookup_min": 1})],
                         ids=["few-rows", "many-rows", "ngram"])
def test_bridged_tokens_equal_per_op_and_transformers(family, monkeypatch, prompts, speculative):
    kind, hf, loaded = family
    calls = []
    real = bridged.layer_bridge

    def spy(*args):
        calls.append((args[1].shape[0], args[-2] is not None, args[-1]))
        return real(*args)

    monkeypatch.setattr(bridged, "layer_bridge", spy)
    on = _generate(loaded, prompts, speculative)
    assert calls and {c[1:] for c in calls} == {(True, ACTIVATION[kind])}  # the family's norms and activation
    assert max(rows for rows, *_ in calls) > (BRIDGE_ROWS if prompts is MANY else 0)
    monkeypatch.setattr(type(loaded.model), "use_bridge", False)
    calls.clear()
    off = _generate(loaded, prompts, speculative)
    assert not calls and on == off
    for p, out in zip(prompts[:3], on):
        assert out == hf_greedy(hf, p, GREEDY.max_tokens)


@pytest.mark.parametrize("kv_dtype", ["fp16", "int8"])
def test_bridged_tokens_equal_per_op_on_other_kv_formats(family, monkeypatch, kv_dtype):
    """fp16: the bridge stores K and V itself (a plain cache); int8: the format's own write runs."""
    _, _, loaded = family
    on = _generate(loaded, MANY, kv_dtype=kv_dtype)
    monkeypatch.setattr(type(loaded.model), "use_bridge", False)
    assert _generate(loaded, MANY, kv_dtype=kv_dtype) == on


def test_gemma_projections_are_fused_views_with_panels_and_the_state_dict_unchanged(family):
    kind, hf, loaded = family
    if not kind.startswith("gemma"):
        pytest.skip("Gemma only")
    LLMEngine(EngineConfig(kv_cache_memory=1 << 22, block_size=8), loaded)  # makes the panel copies
    from kvforge.ops.panels import ATTRIBUTE

    model = loaded.model
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
        assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_up_weight.untyped_storage().data_ptr()
        assert all(hasattr(w, ATTRIBUTE) for w in (attn.qkv_weight, attn.o_proj.weight, mlp.gate_up_weight,
                                                   mlp.down_proj.weight))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: the one row-major table, no panel copy
    assert not hasattr(model.lm_head.weight, ATTRIBUTE)
    ours, theirs = model.state_dict(), hf.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
