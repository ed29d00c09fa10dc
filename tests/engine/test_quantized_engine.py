"""Quantized caches in the engine: prefix sharing and preemption give the same greedy outputs."""
import pytest

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.kv.memory import pool_bytes
from kvforge.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SYSTEM = [(11 * i) % 89 + 3 for i in range(27)]
PROMPTS = [SYSTEM + [40 + i, 50 + i, 60 + (i * 7) % 20][: 1 + i % 3] for i in range(8)] + [SYSTEM[:13], SYSTEM]
# no fp16 window: a block adopted from the prefix cache reads as codes (kv/staging.py), which is what the adopter's
# own prefill would have stored only where the block lies outside its window (tests/engine/test_quant_history.py)
FORMATS = [("int8", {}), ("fp8_e4m3", {"window": 0}), ("int4", {"group_size": 16, "window": 0}),
           ("kivi2", {"group_size": 16, "window": 0})]


def engine(loaded, fmt, opts, caching, blocks=None):
    kw = {"block_size": 8, "max_model_len": 64, "max_num_batched_tokens": 32, "kv_cache_dtype": fmt,
          "kv_cache_options": opts, "enable_prefix_caching": caching, "kv_cache_memory": 1 << 22,
          "kv_staging_share": 1.0}  # the tight pool's sinks for 64 sequences outweigh its 24 blocks
    e = LLMEngine(EngineConfig(**kw), loaded)
    if blocks is None:
        return e
    kw["kv_cache_memory"] = pool_bytes(e.kv_spec, e.format, 8, blocks, e.config.max_num_seqs)
    return LLMEngine(EngineConfig(**kw), loaded)


def run(e):
    ids = [e.add_request(p, GREEDY) for p in PROMPTS]
    done = {}
    while e.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in e.step() if o.finished})
    tree = e.kv.prefix_tree
    assert e.kv.allocator.num_used == (tree.cached_blocks if tree is not None else 0)
    return [done[i] for i in ids]


@pytest.mark.parametrize("fmt,opts", FORMATS, ids=[f for f, _ in FORMATS])
def test_prefix_sharing_and_preemption_keep_outputs(tiny_loaded, fmt, opts):
    alone = run(engine(tiny_loaded, fmt, opts, caching=False))
    shared = engine(tiny_loaded, fmt, opts, caching=True)
    assert run(shared) == alone
    assert shared.stats()["prefix_hit_tokens"] >= 7 * 24
    tight = engine(tiny_loaded, fmt, opts, caching=True, blocks=24)
    assert run(tight) == alone
    assert tight.scheduler.num_preemptions > 0
