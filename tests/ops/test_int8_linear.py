"""kvforge::int8_linear: the compiled kernel against its torch reference, and per-channel quantization bounds."""
import pytest
import torch

from kvforge.ops.build import load_compiled
from kvforge.ops.int8 import dequantize, int8_linear, int8_linear_reference, quantize_per_channel

compiled = pytest.mark.skipif(not load_compiled(), reason="compiled CPU kernels unavailable")


def test_quantization_is_symmetric_per_output_channel():
    w = torch.randn(37, 50, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 37)[:, None]
    w[5] = 0.0
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (37,) and q.abs().max() == 127
    assert torch.equal(q.abs().amax(dim=1)[torch.arange(37) != 5], torch.full((36,), 127, dtype=torch.int8))
    assert torch.equal(q[5], torch.zeros(50, dtype=torch.int8))
    assert ((dequantize(q, scale) - w).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()


@compiled
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16])
@pytest.mark.parametrize("shape", [(960, 576), (37, 50), (8, 16), (130, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_compiled_kernel_matches_reference(rows, shape, bias):
    g = torch.Generator().manual_seed(rows * 1000 + shape[1])
    n, k = shape
    q, scale = quantize_per_channel(torch.randn(n, k, generator=g))
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    ours = torch.ops.kvforge.int8_linear(x, q, scale, b)
    ref = int8_linear_reference(x, q, scale, b)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * k**0.5)


@compiled
def test_dispatch_by_rows_and_leading_dims():
    """Few rows (any leading shape) take the kernel, many the dequantize + BLAS reference: same results."""
    q, scale = quantize_per_channel(torch.randn(64, 96))
    for shape in [(3, 96), (2, 4, 96), (40, 96)]:
        x = torch.randn(*shape)
        out = int8_linear(x, q, scale)
        assert out.shape == (*shape[:-1], 64)
        torch.testing.assert_close(out, int8_linear_reference(x, q, scale), rtol=1e-5, atol=1e-4)
