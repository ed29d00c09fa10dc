"""kvforge::int8_linear: the compiled kernel equals its torch reference bit for bit (both sum the same integers),
quantization bounds of the weights (per output channel) and of the activations (int16 per row)."""
import pytest
import torch

from kvforge.ops.build import load_compiled
from kvforge.ops.int8 import (
    dequantize,
    dequantized_linear,
    int8_linear,
    int8_linear_reference,
    quantize_per_channel,
    quantize_rows_int16,
)

compiled = pytest.mark.skipif(not load_compiled(), reason="compiled CPU kernels unavailable")


def test_quantization_is_symmetric_per_output_channel():
    w = torch.randn(37, 50, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 37)[:, None]
    w[5] = 0.0
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (37,) and q.abs().max() == 127
    assert torch.equal(q.abs().amax(dim=1)[torch.arange(37) != 5], torch.full((36,), 127, dtype=torch.int8))
    assert torch.equal(q[5], torch.zeros(50, dtype=torch.int8))
    assert ((dequantize(q, scale) - w).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()


def test_activation_rows_round_to_int16():
    x = torch.randn(5, 70, generator=torch.Generator().manual_seed(1)) * torch.tensor([1e-3, 1, 10, 0, 300])[:, None]
    xq, scale = quantize_rows_int16(x)
    assert torch.equal(xq, xq.round()) and xq.abs().amax(dim=1).tolist() == [32767.0] * 3 + [0.0, 32767.0]
    assert ((xq * scale[:, None] - x).abs() <= scale[:, None] * 0.501 + x.abs() * 1e-6).all()  # half a step


@compiled
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16])
@pytest.mark.parametrize("shape", [(960, 576), (37, 50), (8, 16), (130, 1536), (8, 9000)])
@pytest.mark.parametrize("bias", [False, True])
def test_compiled_kernel_matches_reference(rows, shape, bias):
    g = torch.Generator().manual_seed(rows * 1000 + shape[1])
    n, k = shape
    q, scale = quantize_per_channel(torch.randn(n, k, generator=g))
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    ours = torch.ops.kvforge.int8_linear(x, q, scale, b)
    assert torch.equal(ours, int8_linear_reference(x, q, scale, b))  # K = 9000: two int32 segments


@compiled
def test_dispatch_by_rows_and_leading_dims():
    """Few rows (any leading shape) take the operator, many the dequantized weight through the BLAS; the two differ
    only by the activations' int16 rounding."""
    q, scale = quantize_per_channel(torch.randn(64, 96))
    for shape in [(3, 96), (2, 4, 96), (40, 96)]:
        x = torch.randn(*shape)
        out = int8_linear(x, q, scale)
        assert out.shape == (*shape[:-1], 64)
        flat = x.reshape(-1, 96)
        want = int8_linear_reference(flat, q, scale) if flat.shape[0] <= 16 else dequantized_linear(flat, q, scale)
        assert torch.equal(out.reshape(-1, 64), want)
        torch.testing.assert_close(out, dequantized_linear(x, q, scale), rtol=1e-3, atol=1e-3)
