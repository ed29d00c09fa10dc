"""kvforge::panel_linear (csrc/panel_matmul.cpp) against F.linear and its torch reference: every row-tile and
panel-tile remainder, K below and above a vector, bias or none; and each output is one in-order sum over k, so a
row's result is the same bit for bit whatever rows share its call and however many threads split the panels."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from thread_count import threads

from kvforge.ops import layers_reference
from kvforge.ops.build import load_compiled
from kvforge.ops.panels import pack_panels, unpack_panels


@pytest.fixture(scope="module", autouse=True)
def compiled():
    if not load_compiled():
        pytest.skip("no compiled kvforge ops on this machine (no compiler, or the build failed)")


def test_packing_round_trips_and_pads_the_last_panel_with_zeros():
    w = torch.randn(37, 5)
    p = pack_panels(w)
    assert p.shape == (3, 5, 16)
    assert torch.equal(unpack_panels(p, 37), w) and not p[2, :, 5:].any()


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 17, 48, 64, 130])
@pytest.mark.parametrize("n,k", [(16, 3), (37, 70), (100, 576), (576, 1536), (960, 577)])
def test_matches_f_linear(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    p = pack_panels(w)
    atol = 1e-4 * max(1.0, (k / 576) ** 0.5)  # one sum in order over k: its rounding grows with sqrt(k)
    for bias in (b, None):
        got = torch.ops.kvforge.panel_linear(x, p, n, bias)
        torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-4, atol=atol)
        torch.testing.assert_close(layers_reference.panel_linear(x, p, n, bias), F.linear(x, w, bias), rtol=1e-4, atol=1e-4)


def test_a_rows_result_does_not_depend_on_its_neighbours_or_the_thread_count():
    gen = torch.Generator().manual_seed(7)
    x, w, b = torch.randn(53, 576, generator=gen), torch.randn(1000, 576, generator=gen), torch.randn(1000, generator=gen)
    p = pack_panels(w)
    whole = torch.ops.kvforge.panel_linear(x, p, 1000, b)
    for lo, hi in [(0, 1), (5, 6), (3, 20), (40, 53)]:
        assert torch.equal(torch.ops.kvforge.panel_linear(x[lo:hi], p, 1000, b), whole[lo:hi])
    for n in (1, 3):
        with threads(n):
            assert torch.equal(torch.ops.kvforge.panel_linear(x, p, 1000, b), whole)


def test_refuses_a_column_count_the_panels_do_not_hold():
    p = pack_panels(torch.randn(37, 8))
    with pytest.raises(RuntimeError, match="3 panels hold 48 columns at most, not 49"):
        torch.ops.kvforge.panel_linear(torch.randn(2, 8), p, 49, None)
    with pytest.raises(RuntimeError, match="not 32"):
        torch.ops.kvforge.panel_linear(torch.randn(2, 8), p, 32, None)


@pytest.mark.parametrize("rows", [1, 9, 17, 64, 300, 600])
@pytest.mark.parametrize("n,k", [(37, 70), (100, 576), (960, 577)])
def test_int8_panels_give_panel_linears_floats_on_the_dequantized_weight_bit_for_bit(rows, n, k):
    from kvforge.ops.int8 import dequantize, quantize_per_channel

    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    q, scale = quantize_per_channel(w)
    dense = dequantize(q, scale)
    for bias in (b, None):
        got = torch.ops.kvforge.int8_panel_linear(x, pack_panels(q), scale, n, bias)
        assert torch.equal(got, torch.ops.kvforge.panel_linear(x, pack_panels(dense), n, bias))
        reference = layers_reference.int8_panel_linear(x, pack_panels(q), scale, n, bias)
        torch.testing.assert_close(reference, F.linear(x, dense, bias), rtol=0, atol=0)
        torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4 * max(1.0, (k / 576) ** 0.5))


def test_int8_panels_refuse_scales_that_do_not_match_the_columns():
    q = pack_panels(torch.randint(-127, 128, (37, 8), dtype=torch.int8))
    with pytest.raises(RuntimeError, match="do not hold 37 columns"):
        torch.ops.kvforge.int8_panel_linear(torch.randn(2, 8), q, torch.ones(36), 37, None)
