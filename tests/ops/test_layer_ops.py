"""Per-layer compiled operators (RMSNorm, in-place RoPE, silu(gate) * up, small_linear) against their torch
references, and the wrappers' choice of path (compiled only for fp32 CPU tensors that need no gradient)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvforge.ops import layers, layers_reference
from kvforge.ops.build import load_compiled


@pytest.fixture(scope="module", autouse=True)
def compiled():
    if not load_compiled():
        pytest.skip("no compiled kvforge ops on this machine (no compiler, or the build failed)")


def test_rms_norm_matches_the_reference():
    gen = torch.Generator().manual_seed(0)
    for shape in [(1, 576), (7, 64), (3, 5, 33)]:
        x, w = torch.randn(*shape, generator=gen) * 3, torch.randn(shape[-1], generator=gen)
        torch.testing.assert_close(torch.ops.kvforge.rms_norm(x, w, 1e-5), layers_reference.rms_norm(x, w, 1e-5),
                                   rtol=1e-5, atol=1e-5)


def test_add_rms_norm_adds_in_place_and_matches_the_reference():
    gen = torch.Generator().manual_seed(3)
    for shape in [(1, 576), (7, 64), (3, 5, 33)]:
        residual, x = torch.randn(*shape, generator=gen) * 3, torch.randn(*shape, generator=gen)
        w = torch.randn(shape[-1], generator=gen)
        want_residual = residual + x
        want = layers_reference.rms_norm(want_residual, w, 1e-5)
        got = torch.ops.kvforge.add_rms_norm_(residual, x, w, 1e-5)
        torch.testing.assert_close(residual, want_residual, rtol=0, atol=0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        ref_residual = want_residual - x
        torch.testing.assert_close(layers_reference.add_rms_norm_(ref_residual, x, w, 1e-5), want, rtol=1e-5, atol=1e-5)


def test_rope_rotates_strided_head_views_in_place():
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 9 + 3 + 3, 64, generator=gen)
    cos, sin = torch.randn(5, 64, generator=gen), torch.randn(5, 64, generator=gen)
    before = qkv.clone()
    q, k, v = qkv.split_with_sizes([9, 3, 3], dim=1)
    layers.rope(q, cos, sin), layers.rope(k, cos, sin)
    for part, (lo, hi) in ((q, (0, 9)), (k, (9, 12))):
        expected = before[:, lo:hi].clone()
        layers_reference.rope_(expected, cos, sin)
        torch.testing.assert_close(qkv[:, lo:hi], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(v, before[:, 12:])  # values untouched


def test_silu_mul_matches_the_reference_over_a_wide_range():
    gate_up = torch.linspace(-90, 90, 2 * 3 * 1536).reshape(3, 2 * 1536)
    gate_up = gate_up[:, torch.randperm(2 * 1536, generator=torch.Generator().manual_seed(2))]
    torch.testing.assert_close(torch.ops.kvforge.silu_mul(gate_up), layers_reference.silu_mul(gate_up),
                               rtol=1e-5, atol=1e-5)


def test_gelu_tanh_mul_matches_the_reference_over_a_wide_range():
    gate_up = torch.linspace(-90, 90, 2 * 3 * 1536).reshape(3, 2 * 1536)
    gate_up = gate_up[:, torch.randperm(2 * 1536, generator=torch.Generator().manual_seed(3))]
    small = torch.randn(2, 2 * 640, generator=torch.Generator().manual_seed(4))  # where GELU curves
    for x in (gate_up, small):
        torch.testing.assert_close(torch.ops.kvforge.gelu_tanh_mul(x), layers_reference.gelu_tanh_mul(x),
                                   rtol=1e-5, atol=1e-5)
    assert torch.ops.kvforge.gelu_tanh_mul(small).shape == (2, 640)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17, 33])
def test_small_linear_matches_f_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    for n, k in [(37, 576), (960, 40), (8, 1536), (9, 7), (5, 100), (11, 50)]:  # K not a multiple of 64, 32 or 16, or < 16
        x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        torch.testing.assert_close(torch.ops.kvforge.small_linear(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.ops.kvforge.small_linear(x, w, None), F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_wrappers_take_the_torch_path_for_gradients_and_other_dtypes():
    w = torch.randn(8, requires_grad=True)
    x = torch.randn(2, 8, requires_grad=True)
    layers.rms_norm(x, w, 1e-6).sum().backward()  # the compiled kernel has no autograd: the reference ran
    assert x.grad is not None and w.grad is not None
    xd = torch.randn(2, 8, dtype=torch.float64)
    torch.testing.assert_close(layers.rms_norm(xd, w.detach().double(), 1e-6),
                               layers_reference.rms_norm(xd, w.detach().double(), 1e-6))


@pytest.mark.parametrize("rows", [1, 2, 5, 33, 300, 600])
def test_linear_matches_f_linear_on_every_path(rows):
    gen = torch.Generator().manual_seed(100 + rows)
    x, w, b = torch.randn(rows, 576, generator=gen), torch.randn(960, 576, generator=gen), torch.randn(960, generator=gen)
    torch.testing.assert_close(layers.linear(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layers.linear(x[:, :7], w[:, :7], None), F.linear(x[:, :7], w[:, :7]), rtol=1e-4, atol=1e-4)


def test_a_weight_gets_one_panel_copy_on_its_first_multi_row_use_and_no_other():
    from kvforge.ops import panels
    from kvforge.ops.packed_weights import ATTRIBUTE

    w = torch.randn(64, 32)
    for rows in range(1, layers.STREAM_ROWS + 1):
        layers.linear(torch.randn(rows, 32), w)
    assert getattr(w, panels.ATTRIBUTE, None) is None  # a few rows run small_linear on the plain weight
    layers.linear(torch.randn(9, 32), w)
    first = getattr(w, panels.ATTRIBUTE)
    for rows in (512, 513, 2048):  # prefill-sized: the same panels, no oneDNN copy
        layers.linear(torch.randn(rows, 32), w)
    assert getattr(w, panels.ATTRIBUTE) is first and getattr(w, ATTRIBUTE, None) is None
    wide_k = torch.randn(64, layers.STREAM_FLOATS // 2 + 1)
    layers.linear(torch.randn(2, wide_k.shape[1]), wide_k)  # two such rows would not stay in L1: panels
    assert getattr(wide_k, panels.ATTRIBUTE, None) is not None
    grad_w = torch.randn(64, 32, requires_grad=True)
    layers.linear(torch.randn(9, 32), grad_w)  # autograd on: the plain path, nothing packed
    assert getattr(grad_w, ATTRIBUTE, None) is None and getattr(grad_w, panels.ATTRIBUTE, None) is None
