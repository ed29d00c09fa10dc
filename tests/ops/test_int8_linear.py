"""kvforge::int8_linear: the compiled kernel equals its torch reference bit for bit (the same integer sums and fp32
operations in the same order), the reference equals the exact sum of its blocks, quantization bounds of the weights
(per output channel) and of the activations (int8 per 32-column block)."""
import pytest
import torch

from kvforge.ops.build import load_compiled
from kvforge.ops.int8 import (
    compiled_for,
    dequantize,
    dequantized_linear,
    in_huge_pages,
    int8_linear,
    int8_linear_reference,
    pack,
    quantize_blocks,
    quantize_per_channel,
    unpack,
)

compiled = pytest.mark.skipif(not load_compiled() or not compiled_for(torch.zeros(1)),
                              reason="compiled CPU kernels unavailable or no AVX-512 VNNI")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_quantization_is_symmetric_per_output_channel():
    w = torch.randn(37, 50, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 37)[:, None]
    w[5] = 0.0
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (37,) and q.abs().max() == 127
    assert torch.equal(q.abs().amax(dim=1)[torch.arange(37) != 5], torch.full((36,), 127, dtype=torch.int8))
    assert torch.equal(q[5], torch.zeros(50, dtype=torch.int8))
    assert ((dequantize(q, scale) - w).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()


def test_packing_interleaves_tiles_of_four_rows_per_chunk_and_round_trips():
    q = torch.randint(-127, 128, (10, 70), dtype=torch.int8)
    packed = pack(q)
    assert packed.shape == (3, 2, 4, 64) and packed.is_contiguous()
    assert torch.equal(packed[1, 0, 2], q[6, :64]) and torch.equal(packed[0, 1, 3, :6], q[3, 64:])
    assert not packed[0, 1, :, 6:].any() and not packed[2, :, 2:].any()  # zeros past K and past N
    assert torch.equal(unpack(packed, 10, 70), q)


def test_huge_page_copies_are_equal_aligned_and_outlive_their_list():
    import gc

    tensors = [torch.randint(-127, 128, (300, 70), dtype=torch.int8), torch.randn(5, 7), pack(torch.ones(9, 3).char())]
    copies = in_huge_pages(tensors)
    first = copies[0]
    del copies
    gc.collect()
    assert torch.equal(first, tensors[0]) and first.data_ptr() % 64 == 0
    copies = in_huge_pages(tensors)
    assert all(torch.equal(a, b) and b.data_ptr() % 64 == 0 for a, b in zip(tensors, copies))


def test_activation_blocks_round_to_int8():
    x = torch.randn(3, 70, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 2, 70)
    x[1, 32:64] = 0.0
    q, scale = quantize_blocks(x)
    assert q.shape == (3, 128) and scale.shape == (3, 4)  # padded to whole 64-column chunks
    assert torch.equal(q, q.round()) and torch.equal(q[:, 70:], torch.zeros(3, 58))
    assert q.abs().amax(dim=1).tolist() == [127.0] * 3 and scale[:, 3].eq(0).all() and scale[1, 1] == 0
    assert torch.equal(q[1, 32:64], torch.zeros(32)) and (scale[:, :3] > 0).sum() == 8
    step = scale.repeat_interleave(32, dim=1)[:, :70]
    assert ((q[:, :70] * step - x).abs() <= step * 0.501 + x.abs() * 1e-6).all()  # half a step per block


def test_reference_is_the_scaled_sum_of_its_block_dot_products():
    """Against float64 sums of (x block scale) * (integer block dot product) * (weight scale): only fp32 rounding."""
    g = torch.Generator().manual_seed(2)
    q, scale = quantize_per_channel(torch.randn(40, 200, generator=g))
    x = torch.randn(3, 200, generator=g)
    xq, block_scale = quantize_blocks(x)
    w = torch.nn.functional.pad(q.double(), (0, xq.shape[1] - 200)).view(40, -1, 32)
    blocks = torch.einsum("mbj,nbj->mnb", xq.double().view(3, -1, 32), w)
    exact = (blocks * block_scale.double()[:, None, :]).sum(dim=2) * scale.double()
    ours = int8_linear_reference(x, pack(q), scale)
    torch.testing.assert_close(ours.double(), exact, rtol=1e-5, atol=1e-5)
    assert 0 < relative_error(ours, dequantized_linear(x, q, scale)) < 0.01  # the int8 rounding of x


@compiled
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16])
@pytest.mark.parametrize("shape", [(960, 576), (37, 50), (8, 16), (130, 1536), (8, 9000), (13, 100), (70, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_compiled_kernel_matches_reference(rows, shape, bias):
    g = torch.Generator().manual_seed(rows * 1000 + shape[1])
    n, k = shape
    q, scale = quantize_per_channel(torch.randn(n, k, generator=g))
    x = torch.randn(rows, k, generator=g) * torch.logspace(-2, 1, k, dtype=torch.float32)
    x[0, : min(k, 40)] = 0.0  # an all-zero block
    b = torch.randn(n, generator=g) if bias else None
    packed = pack(q)
    ours = torch.ops.kvforge.int8_linear(x, packed, scale, b)
    assert torch.equal(ours, int8_linear_reference(x, packed, scale, b))  # K = 16, 33, 50, 100: partial blocks/chunks


@compiled
def test_dispatch_by_rows_and_leading_dims():
    """Few rows (any leading shape) take the operator, many the dequantized weight through the BLAS; the two differ
    only by the activations' int8 rounding."""
    q, scale = quantize_per_channel(torch.randn(64, 96))
    for shape in [(3, 96), (2, 4, 96), (40, 96)]:
        x = torch.randn(*shape)
        out = int8_linear(x, pack(q), scale)
        assert out.shape == (*shape[:-1], 64)
        flat = x.reshape(-1, 96)
        few = flat.shape[0] <= 16
        want = int8_linear_reference(flat, pack(q), scale) if few else dequantized_linear(flat, q, scale)
        assert torch.equal(out.reshape(-1, 64), want)
        assert relative_error(out, dequantized_linear(x, q, scale)) < 0.01


def test_without_the_compiled_kernel_the_reference_serves(monkeypatch):
    monkeypatch.setenv("KVFORGE_OPS", "torch")
    q, scale = quantize_per_channel(torch.randn(24, 80))
    x = torch.randn(2, 80)
    assert not compiled_for(x)
    assert torch.equal(int8_linear(x, pack(q), scale), dequantized_linear(x, q, scale))
