"""The fused layer bridge (csrc/layer_bridge.cpp) against its torch reference, for fp32 and int8 weights, every
form (first layer, between layers, final norm), each family's layer math and thread count; and the engine through
it against the per-op forward (other families: tests/models/test_bridged_families.py)."""
from __future__ import annotations

import pytest
import torch
from bridge_runs import run_tokens
from thread_count import threads

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.models import bridged
from kvforge.models.int8_weights import int8_loaded
from kvforge.models.llama import LlamaForCausalLM
from kvforge.models.loader import load_model
from kvforge.ops import int8, layers_reference, panels
from kvforge.ops.layer_bridge import BRIDGE_ROWS, serves
from kvforge.ops.panels import pack_panels
from kvforge.sampling_params import SamplingParams

HIDDEN, HEADS, KV_HEADS, DIM, EPS = 64, 4, 2, 16, 1e-5
EMPTY = torch.empty(0)


@pytest.fixture(scope="module", autouse=True)
def compiled():
    if not serves(torch.zeros(1, 8)):
        pytest.skip("no compiled layer bridge on this machine (no compiler or no AVX-512)")


def _linear(gen, n, k, quantized, bias=False):
    w = torch.randn(n, k, generator=gen) / k**0.5
    parts = [w, EMPTY]
    if quantized:
        q, scale = int8.quantize_per_channel(w)
        parts = [int8.pack(q), scale]
    return parts + ([torch.randn(n, generator=gen) if bias else EMPTY] if bias is not None else [])


def _weights(seed, inter, quantized, bias):
    gen = torch.Generator().manual_seed(seed)
    norm = lambda: 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
    post = [*_linear(gen, HIDDEN, HEADS * DIM, quantized, bias), norm(), *_linear(gen, 2 * inter, HIDDEN, quantized, None),
            *_linear(gen, HIDDEN, inter, quantized, None)]
    pre = [norm(), *_linear(gen, (HEADS + 2 * KV_HEADS) * DIM, HIDDEN, quantized, bias)]
    return post, pre, [norm()], gen


def _run(op, attn, residual, cos, sin, post, pre, kv_write=(), family_norms=None, activation="silu"):
    residual = residual.clone()
    out = op(attn, residual, cos, sin, post, pre, HEADS, KV_HEADS, EPS, list(kv_write), family_norms, activation)
    return out, residual


def _family_norms(family, gen):
    """[post_attention, post_feedforward, q_norm, k_norm] as Gemma 2, Gemma 3 and Qwen3 have them."""
    norm = lambda n: 1 + 0.5 * torch.randn(n, generator=gen)
    sandwich = [norm(HIDDEN), norm(HIDDEN)] if family.startswith("gemma") else [EMPTY, EMPTY]
    return sandwich + ([norm(DIM), norm(DIM)] if family in ("gemma3", "qwen3") else [EMPTY, EMPTY])


FAMILIES = {"gemma3": "gelu_tanh", "gemma2": "gelu_tanh", "qwen3": "silu"}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rows", [1, 3, 8, 24])
def test_family_layer_math_matches_the_reference(family, rows):
    """Gemma's output norms, GELU-tanh and head norms, Qwen3's head norms; 24 rows: the weights as panels."""
    post, pre, final, gen = _weights(rows, 128, False, False)
    if rows > 8:
        post = [pack_panels(t) if i in (0, 4, 6) else t for i, t in enumerate(post)]
        pre = [pack_panels(t) if i == 1 else t for i, t in enumerate(pre)]
    norms = _family_norms(family, gen)
    attn = torch.randn(rows, HEADS * DIM, generator=gen)
    residual = torch.randn(rows, HIDDEN, generator=gen)
    angles = torch.randn(rows, DIM // 2, generator=gen).repeat(1, 2)
    for a, p_post, p_pre in [(None, [], pre), (attn, post, pre), (attn, post, final)]:
        args = (a, residual, angles.cos(), angles.sin(), p_post, p_pre, (), norms, FAMILIES[family])
        got, got_res = _run(torch.ops.kvforge.layer_bridge, *args)
        want, want_res = _run(layers_reference.layer_bridge, *args)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_res, want_res, rtol=1e-5, atol=1e-5)
        llama = _run(layers_reference.layer_bridge, *args[:-2])[0]
        counts = (a is not None and family != "qwen3") or (p_pre is not final and family != "gemma2")
        assert torch.allclose(want, llama) != counts  # output norms after attention, head norms before it


def test_reference_family_math_is_gemmas_layer():
    """The reference's family math written out as Gemma's decoder computes it, from the layer's input."""
    import torch.nn.functional as F

    post, pre, _, gen = _weights(5, 128, False, False)
    post_attn, post_mlp, q_norm, k_norm = _family_norms("gemma3", gen)
    attn, residual = torch.randn(2, HEADS * DIM, generator=gen), torch.randn(2, HIDDEN, generator=gen)
    cos, sin = torch.ones(2, DIM), torch.zeros(2, DIM)  # RoPE at position 0: the identity
    norm = lambda x, w: layers_reference.rms_norm(x, w, EPS)
    stream = residual + norm(attn @ post[0].T, post_attn)
    gate, up = (norm(stream, post[3]) @ post[4].T).chunk(2, dim=-1)
    stream = stream + norm((F.gelu(gate, approximate="tanh") * up) @ post[6].T, post_mlp)
    qkv = (norm(stream, pre[0]) @ pre[1].T).view(2, -1, DIM)
    want = torch.cat([norm(qkv[:, :HEADS], q_norm), norm(qkv[:, HEADS: HEADS + KV_HEADS], k_norm),
                      qkv[:, HEADS + KV_HEADS:]], dim=1).view(2, -1)
    got, got_res = _run(layers_reference.layer_bridge, attn, residual, cos, sin, post, pre, (),
                        [post_attn, post_mlp, q_norm, k_norm], "gelu_tanh")
    torch.testing.assert_close(got_res, stream, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("inter,bias", [(128, False), (96, True)])
def test_bridge_matches_the_reference(quantized, rows, inter, bias):
    if quantized and not int8.compiled_for(torch.zeros(1, 8)):
        pytest.skip("no int8 kernel (AVX-512 VNNI) on this machine")
    post, pre, final, gen = _weights(rows + inter, inter, quantized, bias)
    attn = torch.randn(rows, HEADS * DIM, generator=gen)
    residual = torch.randn(rows, HIDDEN, generator=gen)
    angles = torch.randn(rows, DIM // 2, generator=gen).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    tol = {"rtol": 2e-3, "atol": 2e-3} if quantized else {"rtol": 1e-5, "atol": 1e-5}
    for a, p_post, p_pre in [(None, [], pre), (attn, post, pre), (attn, post, final)]:
        got, got_res = _run(torch.ops.kvforge.layer_bridge, a, residual, cos, sin, p_post, p_pre)
        want, want_res = _run(layers_reference.layer_bridge, a, residual, cos, sin, p_post, p_pre)
        assert got.shape == want.shape == (rows, HIDDEN if len(p_pre) == 1 else (HEADS + 2 * KV_HEADS) * DIM)
        torch.testing.assert_close(got, want, **tol)
        torch.testing.assert_close(got_res, want_res, **tol)


@pytest.mark.parametrize("rows", [9, 24, 64])
@pytest.mark.parametrize("inter,bias", [(128, False), (96, True)])
def test_bridge_on_panel_weights_matches_the_reference(rows, inter, bias):
    """Steps of more rows pass the fp32 weights as ops/panels.py's panels."""
    post, pre, final, gen = _weights(rows + inter, inter, False, bias)
    post = [pack_panels(t) if i in (0, 4, 6) else t for i, t in enumerate(post)]
    pre = [pack_panels(t) if i == 1 else t for i, t in enumerate(pre)]
    attn = torch.randn(rows, HEADS * DIM, generator=gen)
    residual = torch.randn(rows, HIDDEN, generator=gen)
    angles = torch.randn(rows, DIM // 2, generator=gen).repeat(1, 2)
    for a, p_post, p_pre in [(None, [], pre), (attn, post, pre), (attn, post, final)]:
        got, got_res = _run(torch.ops.kvforge.layer_bridge, a, residual, angles.cos(), angles.sin(), p_post, p_pre)
        want, want_res = _run(layers_reference.layer_bridge, a, residual, angles.cos(), angles.sin(), p_post, p_pre)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_res, want_res, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bridge_stores_the_next_layers_k_and_v_as_the_cache_write_would(dtype):
    post, pre, _, gen = _weights(11, 128, False, True)
    attn, residual = torch.randn(3, HEADS * DIM, generator=gen), torch.randn(3, HIDDEN, generator=gen)
    angles = torch.randn(3, DIM // 2, generator=gen).repeat(1, 2)
    slots = torch.tensor([5, 17, 30])
    got_caches = [torch.full((4, 8, KV_HEADS, DIM), 7.0, dtype=dtype) for _ in range(2)]
    got, _ = _run(torch.ops.kvforge.layer_bridge, attn, residual, angles.cos(), angles.sin(), post, pre,
                  [*got_caches, slots])
    want_caches = [torch.full((4, 8, KV_HEADS, DIM), 7.0, dtype=dtype) for _ in range(2)]
    heads = got.view(3, -1, DIM)  # the bridge's own q/k/v output, stored as the format's write stores it
    for cache, rows in zip(want_caches, (heads[:, HEADS: HEADS + KV_HEADS], heads[:, HEADS + KV_HEADS:])):
        cache.view(-1, KV_HEADS, DIM)[slots] = rows.to(dtype)
    for got_cache, want_cache in zip(got_caches, want_caches):
        assert torch.equal(got_cache, want_cache)  # the rows at the slots, nothing else touched
    ref_caches = [torch.full((4, 8, KV_HEADS, DIM), 7.0, dtype=dtype) for _ in range(2)]
    _run(layers_reference.layer_bridge, attn, residual, angles.cos(), angles.sin(), post, pre, [*ref_caches, slots])
    for got_cache, ref_cache in zip(got_caches, ref_caches):
        torch.testing.assert_close(got_cache.float(), ref_cache.float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("family", [None, "gemma3"])
def test_thread_count_does_not_change_a_value(family):
    post, pre, _, gen = _weights(7, 128, False, True)
    attn, residual = torch.randn(5, HEADS * DIM, generator=gen), torch.randn(5, HIDDEN, generator=gen)
    cos, sin = torch.ones(5, DIM), torch.zeros(5, DIM)
    norms, activation = (_family_norms(family, gen), FAMILIES[family]) if family else (None, "silu")
    outs = []
    for n in (1, 2, 3):
        with threads(n):
            outs.append(_run(torch.ops.kvforge.layer_bridge, attn, residual, cos, sin, post, pre, (), norms,
                             activation))
    for out, res in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(res, outs[0][1])


def test_bad_arguments_say_what_is_expected():
    post, pre, _, gen = _weights(1, 128, False, False)
    residual = torch.randn(2, HIDDEN, generator=gen)
    with pytest.raises(RuntimeError, match="come together"):
        torch.ops.kvforge.layer_bridge(None, residual, torch.ones(2, DIM), torch.zeros(2, DIM), post, pre,
                                       HEADS, KV_HEADS, EPS, [])
    with pytest.raises(RuntimeError, match="qkv must give"):
        torch.ops.kvforge.layer_bridge(None, residual, torch.ones(2, DIM), torch.zeros(2, DIM), [], pre,
                                       HEADS + 1, KV_HEADS, EPS, [])
    with pytest.raises(RuntimeError, match="activation must be 'silu' or 'gelu_tanh'"):
        torch.ops.kvforge.layer_bridge(None, residual, torch.ones(2, DIM), torch.zeros(2, DIM), [], pre,
                                       HEADS, KV_HEADS, EPS, [], None, "relu")
    with pytest.raises(RuntimeError, match="q head norm weight must be contiguous fp32 with 16 elements"):
        torch.ops.kvforge.layer_bridge(None, residual, torch.ones(2, DIM), torch.zeros(2, DIM), [], pre,
                                       HEADS, KV_HEADS, EPS, [], [EMPTY, EMPTY, torch.ones(HIDDEN), EMPTY], "silu")
    caches = [torch.zeros(4, 8, KV_HEADS, DIM), torch.zeros(4, 8, KV_HEADS, DIM)]
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.kvforge.layer_bridge(None, residual, torch.ones(2, DIM), torch.zeros(2, DIM), [], pre,
                                       HEADS, KV_HEADS, EPS, [*caches, torch.tensor([3, 32])])


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[(5 * i + j) % 90 + 3 for j in range(4 + 7 * i)] for i in range(3)]


def _generate(loaded, speculative=None, prompts=PROMPTS):
    return run_tokens(loaded, prompts, GREEDY, speculative)


@pytest.mark.parametrize("weights", ["fp32", "int8"])
@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 2,
                                                "prompt_lookup_min": 1}], ids=["plain", "ngram"])
def test_engine_tokens_same_through_the_bridge(tiny_loaded, monkeypatch, weights, speculative):
    if weights == "int8" and not int8.compiled_for(torch.zeros(1, 8)):
        pytest.skip("no int8 kernel (AVX-512 VNNI) on this machine")
    loaded = int8_loaded(tiny_loaded) if weights == "int8" else tiny_loaded
    calls = []
    real = bridged.layer_bridge
    def spy(*args):
        tensors = [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]
        assert all(t.device.type == "cpu" for t in tensors)  # else the dispatcher runs the torch reference
        calls.append(args[0] is None)
        return real(*args)

    monkeypatch.setattr(bridged, "layer_bridge", spy)
    on = _generate(loaded, speculative)
    assert sum(calls) > 0 and len(calls) > sum(calls)  # steps ran through it, first layer and between layers
    monkeypatch.setattr(LlamaForCausalLM, "use_bridge", False)
    calls.clear()
    off = _generate(loaded, speculative)
    assert not calls
    assert on == off


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_min": 1}], ids=["plain", "ngram"])
def test_steps_of_many_rows_take_the_bridge_on_panels_with_the_same_tokens(tiny_loaded, monkeypatch, speculative):
    prompts = [[(3 * i + j) % 90 + 3 for j in range(3 + 2 * i)] for i in range(12)]
    rows = []
    real = bridged.layer_bridge
    def spy(*args):
        rows.append(args[1].shape[0])
        return real(*args)

    monkeypatch.setattr(bridged, "layer_bridge", spy)
    on = _generate(tiny_loaded, speculative, prompts)
    assert max(rows) > BRIDGE_ROWS  # decode steps of all 12 sequences ran through it
    monkeypatch.setattr(LlamaForCausalLM, "use_bridge", False)
    assert on == _generate(tiny_loaded, speculative, prompts)


def test_the_engine_packs_the_panel_weights_when_built_not_on_the_first_wide_step(tiny_dir, monkeypatch):
    loaded = load_model(tiny_dir)  # fresh weights: no panel copies yet
    projections = [w for layer in loaded.model.model.layers
                   for w in (layer.self_attn.qkv_weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up_weight,
                             layer.mlp.down_proj.weight)]
    assert not any(hasattr(w, panels.ATTRIBUTE) for w in projections)
    LLMEngine(EngineConfig(kv_cache_memory=1 << 24, max_num_seqs=4), loaded)
    assert all(hasattr(w, panels.ATTRIBUTE) for w in projections)
    monkeypatch.setattr(panels, "pack_panels", lambda w: pytest.fail(f"a step packed a weight of {tuple(w.shape)}"))
    _generate(loaded, {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1},
              [[(3 * i + j) % 90 + 3 for j in range(20)] for i in range(4)])


def _block_linear(gen, n, k, qtype, bias=None):
    from gguf.quants import quantize

    w = (torch.randn(n, k, generator=gen) / k**0.5).numpy()
    parts = [torch.from_numpy(quantize(w, qtype).copy()), torch.tensor([int(qtype)])]
    return parts + ([torch.randn(n, generator=gen) if bias else EMPTY] if bias is not None else [])


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("inter,bias", [(128, False), (96, True)])
def test_bridge_on_gguf_block_weights_matches_the_reference(rows, inter, bias):
    from gguf import GGMLQuantizationType as Q

    if not int8.compiled_for(torch.zeros(1, 8)):
        pytest.skip("no VNNI kernels on this machine")
    gen = torch.Generator().manual_seed(rows + inter)
    norm = lambda: 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
    post = [*_block_linear(gen, HIDDEN, HEADS * DIM, Q.Q4_0, bias), norm(), *_block_linear(gen, 2 * inter, HIDDEN, Q.Q4_1),
            *_block_linear(gen, HIDDEN, inter, Q.Q5_0)]
    pre = [norm(), *_block_linear(gen, (HEADS + 2 * KV_HEADS) * DIM, HIDDEN, Q.Q8_0, bias)]
    attn = torch.randn(rows, HEADS * DIM, generator=gen)
    residual = torch.randn(rows, HIDDEN, generator=gen)
    angles = torch.randn(rows, DIM // 2, generator=gen).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    for a, p_post, p_pre in [(None, [], pre), (attn, post, pre), (attn, post, [norm()])]:
        got, got_res = _run(torch.ops.kvforge.layer_bridge, a, residual, cos, sin, p_post, p_pre)
        want, want_res = _run(layers_reference.layer_bridge, a, residual, cos, sin, p_post, p_pre)
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)  # norms in another order, then int8 rounding
        torch.testing.assert_close(got_res, want_res, rtol=2e-3, atol=2e-3)
