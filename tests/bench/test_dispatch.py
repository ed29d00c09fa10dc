"""The dispatch counter: exact counts of a known function, and a decode step's per-layer operators."""
from __future__ import annotations

import pytest
import torch

from kvforge.bench.dispatch import count_ops, decode_step_ops
from kvforge.bench.kv_formats import decode_engine
from kvforge.models.llama import LlamaForCausalLM
from kvforge.ops.build import load_compiled
from kvforge.ops.layer_bridge import serves


def test_counts_each_operator_call():
    x = torch.ones(3)
    ops = count_ops(lambda: (x + 1) * 2 + x)
    assert ops == {"aten.add": 2, "aten.mul": 1}


def test_a_decode_step_runs_each_layer_as_a_few_fused_operators(tiny_loaded, monkeypatch):
    if not load_compiled():
        pytest.skip("no compiled kvforge ops on this machine")
    monkeypatch.setattr(LlamaForCausalLM, "use_bridge", False)
    layers = tiny_loaded.config.num_layers
    ops = decode_step_ops(decode_engine(tiny_loaded, "fp32", 20, 3, 8, 16))
    assert ops["kvforge.rms_norm"] == 1  # the first layer's input norm; each residual add is fused with its norm
    assert ops["kvforge.add_rms_norm_"] == 2 * layers
    assert "aten.add" not in ops
    assert ops["kvforge.rope_"] == 2 * layers
    assert ops["kvforge.silu_mul"] == ops["kvforge.paged_decode"] == layers
    linears = ops["kvforge.small_linear"] + ops["mkldnn._linear_pointwise"] + ops["aten.mm"] + ops["aten.addmm"]
    assert linears == 4 * layers + 1  # qkv, o, gate_up, down per layer (3 rows: oneDNN where available), lm_head
    assert ops["aten.cat"] == 1  # RoPE's cos/sin, once per step for every layer
    assert "aten.pow" not in ops and "aten.neg" not in ops  # no torch RMSNorm or rotate_half left
    assert ops["aten.index"] == 1  # per step, not per layer: the sampled rows of hidden states (plain decode samples
    # every row of the logits as they are)


def test_through_the_bridge_a_layer_is_one_bridge_call_and_one_attention(tiny_loaded, monkeypatch):
    if not serves(torch.zeros(1, 8)):
        pytest.skip("no compiled layer bridge on this machine")
    layers = tiny_loaded.config.num_layers
    ops = decode_step_ops(decode_engine(tiny_loaded, "fp32", 20, 3, 8, 16))
    monkeypatch.setattr(LlamaForCausalLM, "use_bridge", False)
    per_op = decode_step_ops(decode_engine(tiny_loaded, "fp32", 20, 3, 8, 16))
    assert ops["kvforge.layer_bridge"] == layers + 1  # before the first attention, then after each
    assert ops["kvforge.paged_decode"] == layers and "aten.index_put_" not in ops  # the bridge stores K and V
    assert ops["kvforge.small_linear"] == 1  # the LM head
    for fused in ("kvforge.rms_norm", "kvforge.add_rms_norm_", "kvforge.rope_", "kvforge.silu_mul"):
        assert fused not in ops
    assert sum(per_op.values()) - sum(ops.values()) >= 10 * layers  # of about 23 a layer, about 10 left


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_a_gemma_layer_through_the_bridge_is_one_bridge_call_and_one_attention(kind, tmp_path, monkeypatch):
    """Gemma's extra norms, GELU and head norms run inside the bridge: no per-layer operator is left but attention
    (Gemma 2's soft-capped attention takes the torch path, so it has no paged_decode)."""
    if not serves(torch.zeros(1, 8)):
        pytest.skip("no compiled layer bridge on this machine")
    from tiny_models import write_tiny_model

    from kvforge.models.gemma import GemmaForCausalLM
    from kvforge.models.loader import load_model

    write_tiny_model(kind, tmp_path)
    loaded = load_model(str(tmp_path))
    layers = loaded.config.num_layers
    ops = decode_step_ops(decode_engine(loaded, "fp32", 20, 3, 8, 16))
    monkeypatch.setattr(GemmaForCausalLM, "use_bridge", False)
    per_op = decode_step_ops(decode_engine(loaded, "fp32", 20, 3, 8, 16))
    assert ops["kvforge.layer_bridge"] == layers + 1
    assert ops["kvforge.paged_decode"] == (0 if kind == "gemma2" else layers)
    for fused in ("kvforge.rms_norm", "kvforge.add_rms_norm_", "kvforge.rope_", "kvforge.gelu_tanh_mul"):
        assert fused not in ops
    assert per_op["kvforge.gelu_tanh_mul"] == layers and per_op["kvforge.small_linear"] == 4 * layers + 1
    assert per_op["kvforge.add_rms_norm_"] == 2 * layers  # each residual add fused with the norm after it
