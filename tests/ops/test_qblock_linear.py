"""GGUF block weights computed in place (ops/qblocks.py, csrc/qblock_matmul.cpp): the torch dequantization equals
gguf's bit for bit; the integer-dot reference equals the exact sum it describes; the compiled kernels equal their
references (few rows: bit for bit; panel tiles: fp32 tolerance, another order of additions)."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from qblock_checks import compiled_few_rows, reference_is_integer_dot

from kvforge.errors import ConfigError
from kvforge.ops.build import load_compiled
from kvforge.ops.qblocks import (
    BLOCK_TYPES,
    COMPILED_ROWS,
    compiled_for,
    dequantize,
    qblock_linear,
    qblock_linear_reference,
    qblock_panel_linear_reference,
    rows_of,
    to_q8_0,
)

TYPES = [t for t, kind in BLOCK_TYPES.items() if kind.values == 32]  # K-quants: test_kquant_linear.py
compiled = pytest.mark.skipif(not load_compiled() or not compiled_for(torch.zeros(1)),
                              reason="compiled CPU kernels unavailable or no AVX-512 VNNI")


def block_weight(qtype: Q, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 1.0, (n, 1))).astype(np.float32)
    w[1, :32] = 0.0  # an all-zero block
    raw = gguf_quantize(w, qtype)
    return torch.from_numpy(np.ascontiguousarray(raw)), raw


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf_bit_for_bit(qtype):
    blocks, raw = block_weight(qtype, 7, 96)
    expected = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32))
    got = dequantize(blocks, qtype)
    assert got.shape == (7, 96) and torch.equal(got.view(torch.int32), expected.view(torch.int32))
    index = torch.tensor([[3, 0], [6, 3]])
    assert torch.equal(rows_of(blocks, qtype, index), expected[index])


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_0, Q.Q8_0], ids=lambda t: t.name)
def test_offset_only_blocks_convert_to_q8_0_without_loss(qtype):
    blocks, _ = block_weight(qtype, 5, 128, seed=3)
    q8 = to_q8_0(blocks, qtype)
    assert q8.dtype == torch.uint8 and q8.shape == (5, 128 // 32 * 34)
    assert torch.equal(dequantize(q8, Q.Q8_0).view(torch.int32), dequantize(blocks, qtype).view(torch.int32))
    assert torch.equal(q8.view(-1, 34)[:, :2], blocks.view(-1, BLOCK_TYPES[qtype].block_bytes)[:, :2])  # same d


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_1, Q.Q4_K], ids=lambda t: t.name)
def test_types_with_a_min_or_super_blocks_do_not_convert_to_q8_0(qtype):
    with pytest.raises(ConfigError, match="without loss"):
        to_q8_0(torch.zeros(2, BLOCK_TYPES[qtype].block_bytes, dtype=torch.uint8), qtype)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_reference_is_the_integer_dot_product_of_rounded_activations(qtype):
    blocks, _ = block_weight(qtype, 9, 160, seed=1)
    reference_is_integer_dot(blocks, qtype, 160, atol=1e-5)


@compiled
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,k", [(1, 576), (3, 1536), (16, 96), (5, 64), (8, 640), (13, 576), (32, 1024)])
def test_compiled_few_rows_equal_reference_bit_for_bit(qtype, rows, k):
    blocks, _ = block_weight(qtype, 37, k, seed=rows)
    compiled_few_rows(blocks, qtype, rows, k)


@compiled
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,n", [(17, 50), (70, 96)])
def test_compiled_panel_tiles_equal_dequantized_linear(qtype, rows, n):
    k = 192
    blocks, _ = block_weight(qtype, n, k, seed=n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = torch.ops.kvforge.qblock_panel_linear(x, blocks, int(qtype), n, None)
    expected = qblock_panel_linear_reference(x, blocks, int(qtype), n, None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # fp32 sums over k=192 in another order


@pytest.mark.parametrize("rows", [2, 20, 40])
def test_wrapper_takes_leading_dimensions_and_row_counts(rows):
    blocks, _ = block_weight(Q.Q4_1, 8, 64)
    x = torch.randn(rows, 1, 64)
    out = qblock_linear(x, blocks, int(Q.Q4_1))
    assert out.shape == (rows, 1, 8)
    reference = (qblock_linear_reference if rows <= COMPILED_ROWS else qblock_panel_linear_reference)
    torch.testing.assert_close(out[:, 0], reference(x[:, 0], blocks, int(Q.Q4_1), 8), rtol=1e-5, atol=1e-5)
