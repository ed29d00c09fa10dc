"""The bytes an engine's pools really allocate equal the one formula in kv/memory.py."""
import math

import pytest

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.kv.formats import KVFormat, get_format
from kvforge.kv.memory import budget_for, bytes_per_block, bytes_per_token, pool_bytes, sequences_that_fit, side_bytes
from kvforge.kv.spec import KVCacheSpec


@pytest.mark.parametrize("dtype", sorted(KVFormat.registry))
def test_engine_pool_bytes_equal_formula(tiny_loaded, dtype):
    budget = 3 << 20
    options = {"group_size": 16} if dtype in ("int4", "kivi2") else None  # the tiny model's head_dim is 16
    engine = LLMEngine(EngineConfig(kv_cache_memory=budget, kv_cache_dtype=dtype, kv_cache_options=options, block_size=16,
                                    max_num_seqs=4, max_model_len=128), tiny_loaded)
    kv = engine.kv
    expected = pool_bytes(engine.kv_spec, engine.format, 16, kv.num_blocks, 4)
    assert kv.pool.allocated_bytes() == expected <= budget
    assert budget - expected < bytes_per_block(engine.kv_spec, engine.format, 16)  # the budget is used, to one block
    assert kv.block_bytes == bytes_per_block(engine.kv_spec, engine.format, 16)
    if dtype in ("fp32", "fp16", "bf16"):
        assert side_bytes(engine.kv_spec, engine.format, 16, 4) == 0
        assert kv.block_bytes == 16 * 2 * 2 * 16 * 2 * {"fp32": 4, "fp16": 2, "bf16": 2}[dtype]


def test_smollm2_fp32_bytes_per_token(smol_loaded):
    engine = LLMEngine(EngineConfig(kv_cache_memory=64 << 20, max_model_len=512), smol_loaded)
    assert engine.kv.block_bytes == 16 * 2 * 30 * 3 * 64 * 4  # 46,080 bytes per token
    assert engine.kv.pool.allocated_bytes() == engine.kv.num_blocks * engine.kv.block_bytes


SMOL = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, v_head_dim=64)
TABLES = 2 * 4  # staging and sink block -> entry maps, int32 each


def test_int4_block_bytes_counted_by_hand():
    keys = 16 * 3 * 32 + 3 * 64 * (1 + 1) + 3 * 2 * 2  # nibbles; per channel uint8 scale + uint8 zero; zero grid ends
    values = 16 * 3 * 32 + 16 * 3 * (1 + 2)  # nibbles; per row one group of 64: uint8 scale + fp16 zero
    assert bytes_per_block(SMOL, get_format("int4"), 16) == 30 * (keys + values + TABLES)
    assert bytes_per_token(SMOL, get_format("int4"), 16) == 6787.5


def test_int4_and_fp8_e4m3_side_bytes_counted_by_hand():
    """Their fp16 windows (chosen on the evaluation panel) cost per sequence, not per token."""
    row = 3 * 128 * 2  # one token's K and V rows of one layer in fp16
    int4_stage = (get_format("int4").window // 16 + 1) * (16 * row + 12 + 1)  # window blocks + the one filling
    int4_sinks = 2 * (4 * row + 12)
    assert side_bytes(SMOL, get_format("int4"), 16, 1) == 30 * (int4_stage + int4_sinks)
    fp8_stage = (get_format("fp8_e4m3").window // 16 + 1) * (16 * row + 12 + 1)
    assert side_bytes(SMOL, get_format("fp8_e4m3"), 16, 1) == 30 * fp8_stage
    assert bytes_per_token(SMOL, get_format("fp8_e4m3"), 16) == 30 * (2 * 3 * 64 + 2 * 3 * 2) + 30 * 4 / 16  # + staging map
    assert bytes_per_token(SMOL, get_format("int8"), 16) == 30 * (2 * 3 * 64 + 2 * 3 * 2)


def test_kivi2_block_bytes_counted_by_hand():
    outliers = math.ceil(0.01 * 16 * 3 * 64) * (2 + 2)  # int16 index + fp16 value
    keys = 16 * 3 * 16 + 3 * 64 * (1 + 1) + 3 * 2 * 2 + outliers
    values = 16 * 3 * 16 + 16 * 3 * 2 * (1 + 2) + outliers  # two groups of 32 per row
    assert bytes_per_block(SMOL, get_format("kivi2"), 16) == 30 * (keys + values + TABLES)
    stage = (128 // 16 + 1) * (16 * 3 * 128 * 2 + 12 + 1)  # fp16 rows of the window + the block being filled
    sinks = 2 * (4 * 3 * 128 * 2 + 12)
    assert side_bytes(SMOL, get_format("kivi2"), 16, 1) == 30 * (stage + sinks)


@pytest.mark.parametrize("dtype", sorted(KVFormat.registry))
def test_sequences_that_fit_is_the_largest_count_whose_budget_fits(dtype):
    fmt = get_format(dtype)
    for budget in (1 << 26, 1 << 30, 3 * (1 << 30) + 12345):
        n = sequences_that_fit(SMOL, fmt, 16, budget, 2000)
        assert budget_for(SMOL, fmt, 16, 2000, n) <= budget < budget_for(SMOL, fmt, 16, 2000, n + 1)
