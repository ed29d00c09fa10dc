"""Gemma 3 270M (Q4_K_M GGUF: Q4_K attn_output, Q6_K ffn_down beside Q5_0 / Q8_0) under weights="auto": its K-quant
tensors stay as the file's super-block bytes (no fp32 or panel copy), dequantize exactly as the fp32 load does,
and decode runs them through the layer bridge with the same tokens as the per-op path; greedy tokens start as the
fp32 path's (activations rounded to int8 per 32 values may change a later one)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvforge import LLM, EngineConfig, SamplingParams
from kvforge.engine.engine import LLMEngine
from kvforge.models.gguf_header import open_gguf, read_gguf_header
from kvforge.models.loader import load_model
from kvforge.models.quant_weights import block_weights, blocks_of
from kvforge.ops.int8 import compiled_for

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def gemma_path() -> str:
    from kvforge.models.packaged import packaged_model_path

    return packaged_model_path("gemma3-270m")


@pytest.fixture(scope="module")
def gemma_auto(gemma_path):
    return load_model(gemma_path, weights="auto")


def _tokens(loaded, weights: str) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(kv_cache_memory="64MiB", weights=weights), loaded)
    return [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(PROMPTS, PARAMS)]


def test_k_quant_tensors_are_the_files_bytes_and_dequantize_as_the_fp32_load(gemma_path, gemma_auto):
    buf = open_gguf(gemma_path)
    table = {t.name: t for t in read_gguf_header(gemma_path, buf)[1]}
    held = Counter(Q(blocks_of(t).qtype).name for t in block_weights(gemma_auto.model))
    assert held["Q4_K"] == 27 and held["Q6_K"] == 9  # every K-quant tensor of the file, none dequantized
    layer = gemma_auto.model.model.layers[3]
    for name, module in (("blk.3.attn_output.weight", layer.self_attn.o_proj), ("blk.3.ffn_down.weight",
                                                                                  layer.mlp.down_proj)):
        t, qb = table[name], blocks_of(module.weight)
        assert qb.qtype == int(t.qtype) and module.weight.device.type == "meta"
        assert qb.data.numpy().tobytes() == bytes(buf[t.start:t.start + t.nbytes])
    fp32 = load_model(gemma_path, weights="fp32").model.model.layers[3]
    assert torch.equal(blocks_of(layer.self_attn.o_proj.weight).dequantized(), fp32.self_attn.o_proj.weight)
    assert torch.equal(blocks_of(layer.mlp.down_proj.weight).dequantized(), fp32.mlp.down_proj.weight)


def test_mixed_q5_0_q8_0_qkv_fuses_as_q8_0_and_weights_stay_within_1_1x_the_file(gemma_path, gemma_auto):
    from kvforge.models.weight_store import planned_bytes, prepare_weights, resident_bytes

    buf = open_gguf(gemma_path)
    table = {t.name: t for t in read_gguf_header(gemma_path, buf)[1]}
    assert Q(table["blk.0.attn_q.weight"].qtype) == Q.Q5_0 and Q(table["blk.0.attn_v.weight"].qtype) == Q.Q8_0
    for i, layer in enumerate(gemma_auto.model.model.layers):  # 10 layers of Q5_0 q/k with a Q8_0 v, 8 all Q5_0
        parts = {Q(table[f"blk.{i}.attn_{x}.weight"].qtype) for x in "qkv"}
        assert blocks_of(layer.self_attn.qkv_weight).qtype == (Q.Q8_0 if len(parts) > 1 else parts.pop())
    prepare_weights(gemma_auto.model)
    held = resident_bytes(gemma_auto.model)
    assert held <= 1.1 * sum(t.nbytes for t in table.values())
    assert planned_bytes(gemma_auto.config, "auto", gemma_path) == held


def test_decode_runs_k_quants_through_the_bridge_with_the_per_op_tokens(gemma_path, gemma_auto, monkeypatch):
    from kvforge.models import bridged
    from kvforge.models.gemma import GemmaForCausalLM

    if not compiled_for(torch.zeros(1, 8)):
        pytest.skip("no VNNI kernels on this machine")
    qtypes = Counter()
    real = bridged.layer_bridge

    def spy(*args):
        post = args[4]
        qtypes.update(int(post[i + 1]) for i, t in enumerate(post) if t.dtype == torch.uint8)
        return real(*args)

    monkeypatch.setattr(bridged, "layer_bridge", spy)
    on = _tokens(gemma_auto, "auto")
    assert qtypes[int(Q.Q4_K)] > 0 and qtypes[int(Q.Q6_K)] > 0  # o_proj and down_proj as super-blocks
    monkeypatch.setattr(GemmaForCausalLM, "use_bridge", False)
    qtypes.clear()
    assert _tokens(gemma_auto, "auto") == on and not qtypes
    fp32 = _tokens(load_model(gemma_path, weights="fp32"), "fp32")
    assert all(a[:4] == b[:4] for a, b in zip(on, fp32)), (on, fp32)


def test_the_engine_repacks_the_q8_0_lm_head_into_lanes_with_the_same_logits_and_lookups(gemma_path):
    from kvforge.models.weight_store import prepare_weights, resident_bytes
    from kvforge.ops.q8_lanes import Q8_0_LANES

    if not compiled_for(torch.zeros(1, 8)):
        pytest.skip("no VNNI kernels on this machine")
    model = load_model(gemma_path, weights="auto").model
    head = blocks_of(model.lm_head.weight)
    assert head.qtype == int(Q.Q8_0) and model.lm_head.weight is model.model.embed_tokens.weight
    hidden = torch.randn(33, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([0, 7, 262_143, 1234])
    before = [model.compute_logits(hidden[:n]) for n in (1, 8, 33)], model.model.embed_tokens(ids)
    held = resident_bytes(model)
    prepare_weights(model)
    assert blocks_of(model.lm_head.weight).qtype == Q8_0_LANES and resident_bytes(model) == held
    after = [model.compute_logits(hidden[:n]) for n in (1, 8, 33)], model.model.embed_tokens(ids)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])) and torch.equal(before[1], after[1])


def test_batched_decode_of_up_to_32_sequences_takes_the_bridge_with_the_per_op_tokens(gemma_auto, monkeypatch):
    """GGUF block weights run the few-row integer kernels up to COMPILED_ROWS rows on both paths, so steps of 9-32
    rows go through the bridge too, with the same tokens."""
    from kvforge.models import bridged
    from kvforge.models.gemma import GemmaForCausalLM
    from kvforge.ops.layer_bridge import BRIDGE_ROWS
    from kvforge.ops.qblocks import COMPILED_ROWS

    if not compiled_for(torch.zeros(1, 8)):
        pytest.skip("no VNNI kernels on this machine")
    rows = []
    real = bridged.layer_bridge

    def spy(*args):
        rows.append(args[1].shape[0])
        return real(*args)

    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS]  # 12 sequences
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def tokens() -> list[list[int]]:
        engine = LLMEngine(EngineConfig(kv_cache_memory="64MiB", weights="auto"), gemma_auto)
        return [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, params)]

    monkeypatch.setattr(bridged, "layer_bridge", spy)
    on = tokens()
    assert BRIDGE_ROWS < max(rows) <= COMPILED_ROWS
    assert bridged.bridged(gemma_auto.model, torch.zeros(COMPILED_ROWS + 1, 640)) is None  # more: the per-op path
    monkeypatch.setattr(GemmaForCausalLM, "use_bridge", False)
    rows.clear()
    assert tokens() == on and not rows
