"""weights="int8": kvforge with int8 linear weights equals transformers running the same dequantized weights (many
rows: fp32 activations) or the int8 operator's arithmetic in every linear layer (decode's few rows: activations
rounded to int8 per block), and an fp32 engine over the same loaded model is untouched."""
import pytest
import torch
from hf_reference import hf_greedy
from tiny_models import write_tiny_model

from kvforge import LLM, SamplingParams
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.scoring import position_logits
from kvforge.errors import ConfigError
from kvforge.models.int8_weights import INT8, Int8Linear, is_quantized
from kvforge.models.loader import load_model
from kvforge.ops.int8 import dequantize, int8_linear_reference, pack, quantize_per_channel, unpack

TOKENS = torch.randint(0, 96, (50,), generator=torch.Generator().manual_seed(1)).tolist()


@torch.no_grad()
def dequantized_copy(hf):
    """transformers' model with every linear weight (LM head included) replaced by its int8 round trip."""
    import copy

    ref = copy.deepcopy(hf)
    ref.lm_head.weight = torch.nn.Parameter(ref.lm_head.weight.detach().clone())  # untie: the embedding stays fp32
    for module in ref.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.copy_(dequantize(*quantize_per_channel(module.weight)))
    return ref


@torch.no_grad()
def int8_operator_copy(hf):
    """transformers' model with every linear layer (LM head included) computing the int8 operator's reference."""
    import copy

    ref = copy.deepcopy(hf)
    ref.lm_head.weight = torch.nn.Parameter(ref.lm_head.weight.detach().clone())
    for module in ref.modules():
        if isinstance(module, torch.nn.Linear):
            q, scale = quantize_per_channel(module.weight)
            packed = pack(q)

            def forward(x, packed=packed, scale=scale, bias=module.bias):
                out = int8_linear_reference(x.reshape(-1, x.shape[-1]), packed, scale, bias)
                return out.view(*x.shape[:-1], scale.numel())

            module.forward = forward
    return ref


@pytest.mark.parametrize("kind", ["llama-gqa", "gemma3"])
def test_int8_logits_and_greedy_match_transformers_on_dequantized_weights(kind, tmp_path):
    hf = write_tiny_model(kind, tmp_path)
    loaded = load_model(str(tmp_path))
    ref = dequantized_copy(hf)
    engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 22, block_size=4, weights="int8"), loaded)
    assert is_quantized(engine.loaded.model) and not is_quantized(loaded.model)
    with torch.no_grad():
        want, fp32 = ref(torch.tensor([TOKENS])).logits[0], hf(torch.tensor([TOKENS])).logits[0]
    gap = (want - fp32).abs()
    assert gap.max() > 1e-3  # the round trip changes the logits: the comparisons can fail
    # 50 rows: dequantized weights through the BLAS, fp32 activations, as the reference
    torch.testing.assert_close(position_logits(engine, TOKENS, chunk_size=64), want, atol=1e-4, rtol=1e-4)
    # 7 rows: the int8 operator, whose activations are also rounded to int8 per 32-column block
    ours = position_logits(engine, TOKENS, chunk_size=7)
    op_ref = int8_operator_copy(hf)
    with torch.no_grad():
        want_op = op_ref(torch.tensor([TOKENS])).logits[0]
    assert (want_op - want).abs().max() > 1e-3  # the activations' rounding shows
    torch.testing.assert_close(ours, want_op, atol=1e-4, rtol=1e-4)
    llm = LLM.from_engine(engine)
    out = llm.generate([TOKENS[:9]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(op_ref, TOKENS[:9], 10)
    fp32_engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 22, block_size=4), loaded)
    torch.testing.assert_close(position_logits(fp32_engine, TOKENS, chunk_size=7), fp32, atol=1e-4, rtol=1e-4)


def test_every_linear_is_quantized_once_and_its_fp32_original_released(tmp_path):
    write_tiny_model("llama-gqa", tmp_path)
    loaded = load_model(str(tmp_path))
    model = LLMEngine(EngineConfig(kv_cache_memory=1 << 22, weights="int8"), loaded).loaded.model
    layer, base = model.model.layers[0], loaded.model.model.layers[0]
    assert hasattr(layer.self_attn.qkv_weight, INT8) and hasattr(layer.mlp.gate_up_weight, INT8)
    assert isinstance(layer.self_attn.o_proj, Int8Linear) and isinstance(model.lm_head, Int8Linear)
    assert hasattr(layer.self_attn.o_proj.weight, INT8) and hasattr(model.lm_head.weight, INT8)
    assert not isinstance(layer.self_attn.q_proj, Int8Linear)  # a view of the fused q/k/v weight
    released = [layer.self_attn.qkv_weight, layer.mlp.gate_up_weight, layer.self_attn.o_proj.weight,
                layer.self_attn.q_proj.weight, layer.mlp.up_proj.weight, model.lm_head.weight]
    assert all(w.device.type == "meta" for w in released)  # the int8 tree holds no fp32 original
    assert not hasattr(base.self_attn.qkv_weight, INT8) and type(base.self_attn.o_proj) is not Int8Linear
    assert base.self_attn.qkv_weight.device.type == "cpu" and base.self_attn.q_proj.weight.device.type == "cpu"
    assert model.model.embed_tokens.weight is loaded.model.model.embed_tokens.weight  # kept fp32: shared
    state, q, scale = model.state_dict(), *[getattr(layer.self_attn.qkv_weight, INT8)[i] for i in (0, 1)]
    fused = dequantize(unpack(q, *layer.self_attn.qkv_weight.shape), scale)
    rows = base.self_attn.q_proj.weight.shape[0]
    assert torch.equal(state["model.layers.0.self_attn.q_proj.weight"], fused[:rows])  # what it computes with
    assert torch.equal(state["model.layers.0.self_attn.k_proj.weight"], fused[rows: rows + base.self_attn.k_proj.weight.shape[0]])


def test_unknown_weight_kind_is_refused():
    with pytest.raises(ConfigError, match=r"weights must be one of \('auto', 'fp32', 'int8', 'q8_0', 'q4_0'\), got 'int4'"):
        EngineConfig(weights="int4")
