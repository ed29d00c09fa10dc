"""weights="auto" on a GGUF file (models/quant_weights.py): block-quantized tensors stay as the file's block bytes,
with no fp32 copy, and the model computes from them: same state dict as the fp32 load, embeddings looked up
exactly, logits close to the fp32-dequantized model's (activations rounded to int8 per 32 values for a few rows)."""
import numpy as np
import pytest
import torch

from kvforge import LLM, EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.models.gguf_header import open_gguf, read_gguf_header
from kvforge.models.loader import load_model
from kvforge.models.quant_weights import QBlockEmbedding, block_weights, blocks_of, holds_blocks
from kvforge.models.weight_store import planned_bytes, prepare_weights, resident_bytes
from kvforge.ops.qblocks import BLOCK_TYPES
from kvforge.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def smol_blocks(smol_path):
    return load_model(smol_path, weights="auto")


def test_block_tensors_are_held_as_the_files_bytes_and_nothing_else(smol_path, smol_blocks):
    _, table = read_gguf_header(smol_path, open_gguf(smol_path))
    kept = {int(t) for t in BLOCK_TYPES}
    file_bytes = sum(t.nbytes for t in table)
    expected = sum(t.nbytes if int(t.qtype) in kept else 4 * int(np.prod(t.shape)) for t in table)
    model = smol_blocks.model
    assert holds_blocks(model) and isinstance(model.model.embed_tokens, QBlockEmbedding)
    assert blocks_of(model.lm_head.weight) is blocks_of(model.model.embed_tokens.weight)  # the tied head
    prepare_weights(model)  # the engine's layouts: no panel or fp32 copy of a block weight
    assert resident_bytes(model) == expected + model.rotary.inv_freq.nbytes
    assert resident_bytes(model) <= 1.1 * file_bytes
    fused = model.model.layers[0].self_attn
    assert blocks_of(fused.q_proj.weight).data.untyped_storage().data_ptr() == \
        blocks_of(fused.qkv_weight).data.untyped_storage().data_ptr()  # q/k/v views of one fused block tensor
    assert len(block_weights(model)) > 0


def test_state_dict_and_embeddings_equal_the_fp32_load(smol_blocks, smol_loaded):
    ours, fp32 = smol_blocks.model.state_dict(), smol_loaded.model.state_dict()
    assert ours.keys() == fp32.keys()
    assert all(torch.equal(ours[k], fp32[k]) for k in fp32)
    ids = torch.tensor([0, 17, 49151, 17])
    assert torch.equal(smol_blocks.model.model.embed_tokens(ids), smol_loaded.model.model.embed_tokens(ids))


def test_logits_close_to_fp32_and_greedy_tokens_mostly_agree(smol_path, smol_blocks, smol_loaded):
    params = SamplingParams(temperature=0.0, max_tokens=16)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    outs = {}
    for name, loaded, weights in (("auto", smol_blocks, "auto"), ("fp32", smol_loaded, "fp32")):
        engine = LLMEngine(EngineConfig(kv_cache_memory="64MiB", weights=weights), loaded)
        assert engine.weights_mode == ("auto:gguf_blocks" if weights == "auto" else "fp32")
        assert engine.weight_bytes == planned_bytes(loaded.config, weights, smol_path)  # kvforge memory's count
        assert engine._model_key().weights_mode == engine.weights_mode  # tiers never mix the two
        outs[name] = [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, params)]
    first = [a[:4] == b[:4] for a, b in zip(outs["auto"], outs["fp32"])]
    assert all(first), outs  # integer dot products may change a later greedy token, not the first ones


def test_prefill_rows_compute_from_blocks_close_to_fp32(smol_blocks, smol_loaded):
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(0))
    ours = smol_blocks.model.compute_logits(x)
    fp32 = smol_loaded.model.compute_logits(x)
    assert ((ours - fp32).norm() / fp32.norm()).item() < 1e-5  # 40 rows: fp32 activations on dequantized tiles
    one = smol_blocks.model.compute_logits(x[:1])
    assert ((one - fp32[:1]).norm() / fp32[:1].norm()).item() < 0.02  # one row: int8 activations


def test_decode_of_block_weights_runs_through_the_bridge_with_the_per_op_tokens(smol_blocks, monkeypatch):
    from kvforge.models import bridged
    from kvforge.models.llama import LlamaForCausalLM
    from kvforge.ops.int8 import compiled_for

    if not compiled_for(torch.zeros(1, 8)):
        pytest.skip("no VNNI kernels on this machine")
    calls = []
    real = bridged.layer_bridge

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(bridged, "layer_bridge", spy)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = ["The capital of France is", "Write a haiku about the sea."]

    def tokens():
        engine = LLMEngine(EngineConfig(kv_cache_memory="64MiB", weights="auto"), smol_blocks)
        return [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, params)]

    on = tokens()
    assert calls and all(args[4] == [] or args[4][0].dtype == torch.uint8 for args in calls)  # o_proj as blocks
    monkeypatch.setattr(LlamaForCausalLM, "use_bridge", False)
    calls.clear()
    off = tokens()
    assert not calls and on == off


def test_q8_0_at_load_writes_ggufs_bytes_and_computes_close_to_fp32(tiny_loaded):
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    from kvforge.models.requantize import q8_0_blocks, q8_0_loaded

    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(0))
    w[0, :32] = 0.0
    assert np.array_equal(q8_0_blocks(w).numpy(), quantize(w.numpy(), Q.Q8_0))
    q8 = q8_0_loaded(tiny_loaded)
    assert holds_blocks(q8.model) and not holds_blocks(tiny_loaded.model)  # a copy: the fp32 model is unchanged
    layer = q8.model.model.layers[0]
    assert blocks_of(layer.self_attn.q_proj.weight).data.untyped_storage().data_ptr() == \
        blocks_of(layer.self_attn.qkv_weight).data.untyped_storage().data_ptr()
    ours, fp32 = q8.model.state_dict(), tiny_loaded.model.state_dict()
    assert ours.keys() == fp32.keys()
    worst = max(((ours[k] - fp32[k]).abs().max() / fp32[k].abs().max().clamp_min(1e-12)).item() for k in fp32)
    assert worst <= 0.5 / 127 + 1e-3  # half a code step of each block's scale, and the fp16 scale's rounding
    params = SamplingParams(temperature=0.0, max_tokens=8)
    engine = LLMEngine(EngineConfig(kv_cache_memory="8MiB", weights="q8_0"), tiny_loaded)
    assert engine.weights_mode == "q8_0" and holds_blocks(engine.loaded.model)
    assert len(LLM.from_engine(engine).generate([[1, 2, 3, 4]], params)[0].outputs[0].token_ids) == 8


def test_q4_0_at_load_writes_ggufs_bytes_keeps_the_tables_q8_0_and_shrinks_the_engine(tiny_loaded):
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    from kvforge.models.requantize import q4_0_blocks, requantized

    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(1))
    w[0, :32] = 0.0  # a zero block: d = 0, codes 8
    w[1, 32:64] = torch.linspace(-1, 1, 32)  # -1 and 1 tie for the largest magnitude: the first one sets d
    assert np.array_equal(q4_0_blocks(w).numpy(), quantize(w.numpy(), Q.Q4_0))
    q4 = requantized(tiny_loaded, "q4_0")
    model = q4.model
    layer = model.model.layers[0]
    assert blocks_of(layer.self_attn.qkv_weight).qtype == blocks_of(layer.mlp.down_proj.weight).qtype == int(Q.Q4_0)
    assert blocks_of(layer.self_attn.q_proj.weight).data.untyped_storage().data_ptr() == \
        blocks_of(layer.self_attn.qkv_weight).data.untyped_storage().data_ptr()
    assert blocks_of(model.model.embed_tokens.weight).qtype == blocks_of(model.lm_head.weight).qtype == int(Q.Q8_0)
    fp32 = tiny_loaded.model.state_dict()
    down = "model.layers.0.mlp.down_proj.weight"
    expected = dequantize(quantize(fp32[down].numpy(), Q.Q4_0), Q.Q4_0)
    assert np.array_equal(model.state_dict()[down].numpy(), expected)
    engine = LLMEngine(EngineConfig(kv_cache_memory="8MiB", weights="q4_0"), tiny_loaded)
    assert engine.weights_mode == "q4_0" and not holds_blocks(tiny_loaded.model)
    fp32_engine = LLMEngine(EngineConfig(kv_cache_memory="8MiB", weights="fp32"), tiny_loaded)
    linear = sum(fp32[k].numel() for k in fp32 if k.endswith("proj.weight"))
    tables = fp32["model.embed_tokens.weight"].numel() + fp32["lm_head.weight"].numel()
    assert engine.weight_bytes < fp32_engine.weight_bytes
    assert engine.weight_bytes - (linear * 18 // 32 + tables * 34 // 32) == sum(
        fp32[k].nbytes for k in fp32 if "norm" in k) + model.rotary.inv_freq.nbytes
    params = SamplingParams(temperature=0.0, max_tokens=8)
    assert len(LLM.from_engine(engine).generate([[1, 2, 3, 4]], params)[0].outputs[0].token_ids) == 8
