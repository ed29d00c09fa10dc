"""Chunked scoring with the default chunk (one block) sees exactly what token-by-token decode sees."""
import pytest
import torch

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.scoring import position_logits

BLOCK = 8  # the tiny model has head_dim 16: groups of 16
PLAIN_KIVI = {"group_size": 16, "window": 0, "sinks": 0, "outlier_frac": 0.0}
FORMATS = [("int8", {}), ("int4", {"group_size": 16}), ("kivi2", {"group_size": 16, "window": 16}), ("kivi2", PLAIN_KIVI)]


def logits(loaded, fmt, opts, tokens, chunk):
    engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 22, block_size=BLOCK, max_num_seqs=1, kv_cache_dtype=fmt,
                                    kv_cache_options=opts, enable_prefix_caching=False), loaded)
    out = position_logits(engine, tokens, chunk_size=chunk)
    assert engine.kv.allocator.num_used == 0
    return out


@pytest.mark.parametrize("fmt,opts", FORMATS, ids=[f"{f}{o}" for f, o in FORMATS])
def test_default_chunk_equals_one_token_at_a_time(tiny_loaded, fmt, opts):
    tokens = torch.randint(0, 96, (45,), generator=torch.Generator().manual_seed(3)).tolist()
    decode = logits(tiny_loaded, fmt, opts, tokens, 1)
    torch.testing.assert_close(logits(tiny_loaded, fmt, opts, tokens, None), decode, atol=1e-4, rtol=1e-4)


def test_longer_chunks_see_their_own_block_quantized(tiny_loaded):
    """Why the default is one block: with staged formats a longer chunk is not what decode sees."""
    tokens = torch.randint(0, 96, (45,), generator=torch.Generator().manual_seed(3)).tolist()
    decode = logits(tiny_loaded, "kivi2", PLAIN_KIVI, tokens, 1)
    long = logits(tiny_loaded, "kivi2", PLAIN_KIVI, tokens, 4 * BLOCK)
    assert (long - decode).abs().max() > 1e-3
