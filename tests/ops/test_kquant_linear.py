"""GGUF K-quant weights (Q4_K, Q5_K, Q6_K: super-blocks of 256, ops/kquants.py) computed in place: the torch
dequantization equals gguf's bit for bit; the integer-dot reference equals the exact sum it describes; the compiled
kernels equal their references (few rows: bit for bit; panel tiles: fp32 tolerance) and F.linear on the
dequantized weight up to int8 activations. gguf cannot quantize K-quants, so the blocks are random bytes (every
code, scale and min bit pattern) with finite fp16 super-block scales."""
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from qblock_checks import compiled_few_rows, reference_is_integer_dot

from kvforge.errors import ConfigError
from kvforge.ops.build import load_compiled
from kvforge.ops.qblocks import (
    block_type,
    compiled_for,
    dequantize,
    qblock_linear,
    qblock_panel_linear_reference,
    rows_of,
)

K_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
compiled = pytest.mark.skipif(not load_compiled() or not compiled_for(torch.zeros(1)),
                              reason="compiled CPU kernels unavailable or no AVX-512 VNNI")


def kquant_weight(qtype: Q, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    rng = np.random.default_rng(seed)
    values, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n * k // values, nbytes), dtype=np.uint8)
    for at in ([208] if qtype == Q.Q6_K else [0, 2]):  # d (and dmin): finite, varied per super-block
        raw[:, at:at + 2] = rng.uniform(1e-4, 2e-2, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(n, -1)
    return torch.from_numpy(raw.copy()), raw


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf_bit_for_bit(qtype):
    blocks, raw = kquant_weight(qtype, 7, 512)
    expected = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32))
    got = dequantize(blocks, qtype)
    assert got.shape == (7, 512) and torch.equal(got.view(torch.int32), expected.view(torch.int32))
    index = torch.tensor([[3, 0], [6, 3]])
    assert torch.equal(rows_of(blocks, qtype, index), expected[index])


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_reference_is_the_integer_dot_product_of_rounded_activations(qtype):
    blocks, _ = kquant_weight(qtype, 9, 768, seed=1)
    reference_is_integer_dot(blocks, qtype, 768, atol=1e-4)


def test_k_quant_needs_whole_super_blocks():
    blocks, _ = kquant_weight(Q.Q4_K, 2, 256)
    assert block_type(Q.Q4_K).values == 256
    with pytest.raises(ConfigError, match="Q8_0"):
        block_type(Q.Q2_K)
    with pytest.raises(RuntimeError, match="multiple"):
        torch.ops.kvforge.qblock_linear(torch.zeros(1, 128), blocks[:, :72], int(Q.Q4_K), 2, None)


@compiled
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,k", [(1, 1024), (3, 256), (16, 2048), (5, 512), (9, 768), (32, 1280)])
def test_compiled_few_rows_equal_reference_bit_for_bit(qtype, rows, k):
    blocks, _ = kquant_weight(qtype, 37, k, seed=rows)
    got, full = compiled_few_rows(blocks, qtype, rows, k)
    assert (got - full).norm() / full.norm() < 0.02


@compiled
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,n", [(40, 50), (70, 96)])
def test_compiled_panel_tiles_equal_dequantized_linear(qtype, rows, n):
    k = 512
    blocks, _ = kquant_weight(qtype, n, k, seed=n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = torch.ops.kvforge.qblock_panel_linear(x, blocks, int(qtype), n, None)
    expected = qblock_panel_linear_reference(x, blocks, int(qtype), n, None)
    magnitude = x.abs() @ dequantize(blocks, qtype).abs().T
    assert ((got - expected).abs() <= 1e-6 * magnitude).all()  # fp32 sums over k=512 in another order
    unit = torch.eye(k)[:rows]  # unit rows read the dequantized panels back: exactly gguf's values
    dequantized = torch.ops.kvforge.qblock_panel_linear(unit, blocks, int(qtype), n, None)
    assert torch.equal(dequantized, dequantize(blocks, qtype).T[:rows])
    assert torch.equal(qblock_linear(x, blocks, int(qtype)), got)  # the wrapper takes the panel path past COMPILED_ROWS
