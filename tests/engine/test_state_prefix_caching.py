"""Prefix caching on recurrent models: state checkpoints at block boundaries let a new request resume from the
deepest prefix-tree node that has both its KV blocks and a checkpoint, with 16-token blocks (no page padding);
outputs are the same with prefix caching on or off, when a prompt extends a cached one or diverges inside a block,
and when a checkpoint was evicted (the request resumes from a shallower node)."""
import pytest
import torch
from hf_reference import hf_greedy_recomputed
from tiny_models import write_tiny_model

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.kv.state_checkpoints import checkpoint_key
from kvforge.models.loader import load_model
from kvforge.sampling_params import SamplingParams
from kvforge.server.metrics import ServerMetrics

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BASE = torch.randint(0, 96, (120,), generator=torch.Generator().manual_seed(7)).tolist()
OTHER = torch.randint(0, 96, (60,), generator=torch.Generator().manual_seed(8)).tolist()


@pytest.fixture(scope="module", params=["granite-hybrid", "lfm2", "rwkv", "qwen3-next"])
def model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf = write_tiny_model(request.param, d)
    return load_model(str(d)), hf


def _engine(loaded, caching=True, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory=4 << 20, max_num_seqs=4, max_num_batched_tokens=64,
                                  enable_prefix_caching=caching, **options), loaded)


def _run(engine, prompt) -> tuple[list[int], int]:
    """Greedy tokens of one request run alone, and the prompt tokens it found cached."""
    rid = engine.add_request(prompt, GREEDY)
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.request_id == rid and o.finished), out)
    return out.token_ids, out.metrics.cached_tokens


def test_hits_resume_from_checkpoints_with_the_same_tokens(model):
    loaded, hf = model
    cached, plain = _engine(loaded), _engine(loaded, caching=False)
    prompts = {
        "first": BASE[:70],
        "same again": BASE[:70],  # resumes at its last whole block: 64
        "extends it": BASE[:100],  # the first one's checkpoint at 64 (its blocks up to 64 + generated)
        "diverges at 40": BASE[:40] + OTHER[:30],  # inside block 2: the checkpoint at 32
        "unrelated": OTHER,
    }
    want_cached = {"first": 0, "same again": 64, "extends it": 64, "diverges at 40": 32, "unrelated": 0}
    for name, prompt in prompts.items():
        tokens, hit = _run(cached, prompt)
        assert hit == want_cached[name], name
        assert tokens == _run(plain, prompt)[0] == hf_greedy_recomputed(hf, prompt, 8), name
    stats = cached.stats()
    assert stats["state_checkpoints_hit"] == 3
    assert stats["state_checkpoints_stored"] >= 4 and stats["state_checkpoint_bytes"] == cached.state_bytes
    assert stats["prefix_hits_short_of_checkpoint"] == 0
    assert cached.kv.allocator.num_used == cached.kv.prefix_tree.cached_blocks
    assert cached.kv.state_pool.num_used == 0


def test_an_evicted_checkpoint_resumes_from_a_shallower_node(model):
    loaded, hf = model
    engine = _engine(loaded)
    _run(engine, BASE[:70])
    assert engine.kv.checkpoints.discard(checkpoint_key(None, BASE[:64]))
    assert engine.kv.checkpoints.discard(checkpoint_key(None, BASE[:48]))
    tokens, hit = _run(engine, BASE[:80])  # KV cached for 64 tokens (and more); checkpoints left at 16 and 32
    assert hit == 32
    assert tokens == hf_greedy_recomputed(hf, BASE[:80], 8)
    stats = engine.stats()
    assert stats["prefix_hits_short_of_checkpoint"] == 1 and stats["prefix_tokens_short_of_checkpoint"] >= 32
    assert stats["state_checkpoints_evicted"] == 2
    metrics = dict(line.rsplit(" ", 1) for line in ServerMetrics().render(stats).splitlines() if line[0] != "#")
    assert float(metrics["kvforge_prefix_hits_short_of_checkpoint_total"]) == 1
    assert float(metrics["kvforge_state_checkpoints_evicted_total"]) == 2


def test_a_small_checkpoint_budget_keeps_the_newest_and_stays_exact(model):
    """Room for two checkpoints: an interval of 2 blocks keeps 32 and 64 of the first prompt, LRU evicts the rest."""
    loaded, hf = model
    probe = _engine(loaded)
    engine = _engine(loaded, state_checkpoint_memory=2 * probe.state_bytes, state_checkpoint_interval=2)
    _run(engine, BASE[:110])  # boundaries 32, 64, 96 -> 64 and 96 stay
    assert engine.kv.checkpoints.evicted == 1 and len(engine.kv.checkpoints) == 2
    tokens, hit = _run(engine, BASE[:70] + OTHER[:20])
    assert hit == 64
    assert tokens == hf_greedy_recomputed(hf, BASE[:70] + OTHER[:20], 8)
    tokens, hit = _run(engine, BASE[:40])  # its own block 32 was evicted: no resume
    assert hit == 0 and tokens == hf_greedy_recomputed(hf, BASE[:40], 8)


def test_batched_requests_sharing_a_prefix_match_plain_decoding(model):
    """A shared 50-token prefix among requests running together; a later wave resumes from their checkpoints."""
    loaded, _ = model
    prompts = [BASE[:50] + OTHER[i:i + 5 + i] for i in range(4)]
    results = {}
    for caching in (True, False):
        engine = _engine(loaded, caching=caching)
        for p in prompts:
            engine.add_request(p, GREEDY, request_id=f"a{len(p)}")
        first = _drain(engine)
        for p in prompts:
            engine.add_request(p, GREEDY, request_id=f"b{len(p)}")
        second = _drain(engine)
        results[caching] = (first, second)
        if caching:
            assert engine.kv.stats()["state_checkpoints_hit"] >= 4
    assert results[True] == results[False]


def _drain(engine) -> dict[str, list[int]]:
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return outs


def test_the_next_turn_of_a_chat_resumes_after_the_output(model):
    """A checkpoint taken while decoding (the output crossed block 64) serves the next turn: a hit of 64, not of
    the first prompt's last whole block (48)."""
    loaded, hf = model
    engine = _engine(loaded)
    first, _ = _run(engine, BASE[:60])
    turn = BASE[:60] + first + OTHER[:10]
    tokens, hit = _run(engine, turn)
    assert hit == 64
    assert tokens == hf_greedy_recomputed(hf, turn, 8)
