"""Q8_0 weights in the few-row kernel's lane layout (ops/q8_lanes.py, csrc/q8_lanes.cpp): the same bytes, unpacked to
the file's blocks exactly; the compiled kernels on it give the Q8_0 kernels' floats bit for bit (few rows and panel
tiles) and the reference's; the embedding lookup and dequantization read it as the file's values."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize as gguf_quantize

from kvforge.ops.build import load_compiled
from kvforge.ops.q8_lanes import Q8_0_LANES, pack, packs, unpack, unpack_rows
from kvforge.ops.qblocks import COMPILED_ROWS, compiled_for, dequantize, qblock_linear_reference, rows_of

compiled = pytest.mark.skipif(not load_compiled() or not compiled_for(torch.zeros(1)),
                              reason="compiled CPU kernels unavailable or no AVX-512 VNNI")
SHAPES = [(64, 640), (128, 512), (36, 1152), (8, 128)]  # K = 512 G or 512 G + 128 (Gemma 3's 640)


def q8_0(n: int, k: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 1.0, (n, 1))).astype(np.float32)
    w[1, 32:64] = 0.0
    return torch.from_numpy(np.ascontiguousarray(gguf_quantize(w, Q.Q8_0)))


def test_which_shapes_take_the_lane_layout():
    assert packs(8, (64, 640 // 32 * 34)) and packs(8, (4, 512 // 32 * 34)) and packs(8, (4, 128 // 32 * 34))
    assert not packs(8, (6, 640 // 32 * 34))  # rows not in fours
    assert not packs(8, (64, 576 // 32 * 34))  # 18 blocks: a tail of 2
    assert not packs(int(Q.Q4_0), (64, 640 // 32 * 18))


@pytest.mark.parametrize("n,k", SHAPES)
def test_pack_keeps_the_bytes_and_unpacks_exactly(n, k):
    blocks = q8_0(n, k)
    packed = pack(blocks)
    assert packed.shape == blocks.shape and packed.dtype == torch.uint8 and not torch.equal(packed, blocks)
    assert torch.equal(unpack(packed), blocks)
    index = torch.tensor([n - 1, 0, 5, 5])
    assert torch.equal(unpack_rows(packed, index), blocks[index])
    assert torch.equal(dequantize(packed, Q8_0_LANES), dequantize(blocks, Q.Q8_0))
    assert torch.equal(rows_of(packed, Q8_0_LANES, index.view(2, 2)), rows_of(blocks, Q.Q8_0, index.view(2, 2)))


@compiled
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 7, COMPILED_ROWS])
def test_few_row_kernel_on_lanes_equals_q8_0_and_the_reference_bit_for_bit(n, k, rows):
    blocks = q8_0(n, k, seed=rows)
    packed = pack(blocks)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
    x[0, :32] = 0.0
    bias = torch.randn(n)
    got = torch.ops.kvforge.qblock_linear(x, packed, Q8_0_LANES, n, bias)
    assert torch.equal(got, torch.ops.kvforge.qblock_linear(x, blocks, int(Q.Q8_0), n, bias))
    assert torch.equal(got, qblock_linear_reference(x, packed, Q8_0_LANES, n, bias))
    assert torch.equal(got, qblock_linear_reference(x, blocks, int(Q.Q8_0), n, bias))


@compiled
@pytest.mark.parametrize("n,k", SHAPES[:2])
def test_panel_kernel_on_lanes_equals_q8_0s(n, k):
    blocks = q8_0(n, k, seed=7)
    x = torch.randn(COMPILED_ROWS + 9, k)
    got = torch.ops.kvforge.qblock_panel_linear(x, pack(blocks), Q8_0_LANES, n, None)
    assert torch.equal(got, torch.ops.kvforge.qblock_panel_linear(x, blocks, int(Q.Q8_0), n, None))
    torch.testing.assert_close(got, x @ dequantize(blocks, Q.Q8_0).T, rtol=1e-5, atol=1e-4)


@compiled
def test_a_shape_the_layout_does_not_take_is_refused():
    blocks = q8_0(6, 640)
    with pytest.raises(RuntimeError, match="lane layout needs n a multiple of 4"):
        torch.ops.kvforge.qblock_linear(torch.randn(1, 640), blocks, Q8_0_LANES, 6, None)
