"""A KV pool costs address space, not RAM: pages are committed as blocks are first written (kv/lazy_zeros.py)."""
import gc

import pytest
import torch

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.kv.lazy_zeros import lazy_zeros
from kvforge.llm import LLM
from kvforge.sampling_params import SamplingParams

MiB = 1 << 20
BUDGET = 2 << 30


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_lazy_zeros_read_as_zeros_and_commit_what_is_written():
    before = rss_bytes()
    t = lazy_zeros(1024, 64, 1024, dtype=torch.float32, device="cpu")  # 256 MiB
    assert rss_bytes() - before < 8 * MiB
    assert t.shape == (1024, 64, 1024) and t.is_contiguous() and not bool(t[::97].any())
    t[:128] = 1.0  # 32 MiB
    grown = rss_bytes() - before
    assert 30 * MiB < grown < 48 * MiB
    assert float(t[:128].sum()) == 128 * 64 * 1024 and not bool(t[128:].any())


def test_small_and_non_cpu_tensors_are_plain_zeros():
    small = lazy_zeros(16, 4, dtype=torch.int32, device="cpu")
    assert small.dtype == torch.int32 and not bool(small.any())


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_engine_with_a_large_budget_commits_only_the_blocks_it_uses(tiny_loaded, dtype):
    gc.collect()
    before = rss_bytes()
    engine = LLMEngine(EngineConfig(kv_cache_memory=BUDGET, kv_cache_dtype=dtype, max_model_len=256, max_num_seqs=4),
                       tiny_loaded)
    pool = engine.kv.pool
    assert pool.allocated_bytes() > 0.99 * BUDGET  # the contract holds: the pool spans the budget
    built = rss_bytes() - before
    assert built < 64 * MiB, f"building a {BUDGET >> 20} MiB pool committed {built >> 20} MiB"

    # Every layer slot written in its first n blocks commits about n blocks' bytes, and no more.
    n = (48 * MiB) // engine.kv.block_bytes
    slots = torch.arange(n * engine.kv.block_size)
    spec = engine.kv_spec
    k = torch.randn(len(slots), spec.num_kv_heads, spec.head_dim)
    v = torch.randn(len(slots), spec.num_kv_heads, spec.v_head_dim)
    start = rss_bytes()
    for chunk in range(0, len(slots), 4096):  # small steps: their temporaries are reused, not new pages
        rows = slice(chunk, chunk + 4096)
        for layer in pool.slots:
            layer.write(slots[rows], k[rows], v[rows], slots[rows])
    written = rss_bytes() - start
    assert 0.8 * n * engine.kv.block_bytes < written < 1.5 * n * engine.kv.block_bytes + 16 * MiB
    untouched = torch.arange(engine.kv.num_blocks - 4, engine.kv.num_blocks)
    gk, gv = pool.slots[0].gather(untouched)
    assert not bool(gk.any()) and not bool(gv.any())  # fresh blocks read as zeros

    out = LLM.from_engine(engine).generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4
    engine.close()
