"""The bytes an engine's pools really allocate equal the one formula in kv/memory.py."""
import pytest

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.kv.formats import KVFormat
from kvforge.kv.memory import bytes_per_block, pool_bytes, side_bytes


@pytest.mark.parametrize("dtype", sorted(KVFormat.registry))
def test_engine_pool_bytes_equal_formula(tiny_loaded, dtype):
    budget = 3 << 20
    options = {"group_size": 16} if dtype in ("int4", "kivi2") else None  # the tiny model's head_dim is 16
    engine = LLMEngine(EngineConfig(kv_cache_memory=budget, kv_cache_dtype=dtype, kv_cache_options=options, block_size=16,
                                    max_num_seqs=4, max_model_len=128), tiny_loaded)
    kv = engine.kv
    expected = pool_bytes(engine.spec, engine.format, 16, kv.num_blocks, 4)
    assert kv.pool.allocated_bytes() == expected <= budget
    assert budget - expected < bytes_per_block(engine.spec, engine.format, 16)  # the budget is used, to one block
    assert kv.block_bytes == bytes_per_block(engine.spec, engine.format, 16)
    if dtype in ("fp32", "fp16", "bf16"):
        assert side_bytes(engine.spec, engine.format, 16, 4) == 0
        assert kv.block_bytes == 16 * 2 * 2 * 16 * 2 * {"fp32": 4, "fp16": 2, "bf16": 2}[dtype]


def test_smollm2_fp32_bytes_per_token(smol_loaded):
    engine = LLMEngine(EngineConfig(kv_cache_memory=64 << 20, max_model_len=512), smol_loaded)
    assert engine.kv.block_bytes == 16 * 2 * 30 * 3 * 64 * 4  # 46,080 bytes per token
    assert engine.kv.pool.allocated_bytes() == engine.kv.num_blocks * engine.kv.block_bytes
