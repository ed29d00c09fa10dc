"""Per-head roles in the engine: streaming heads keep sinks + their newest rows, retrieval heads H2O's heavy hitters
with no recent window, the others H2O's choice; the
compaction frees real blocks and the scores match a dense cache masked per layer and KV head (evict_sim)."""
import pytest
import torch

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.scoring import iter_chunk_logits
from kvforge.errors import ConfigError
from kvforge.eval.evict_sim import SimConfig, simulate
from kvforge.kv.memory import blocks_for_tokens
from kvforge.kv.policies import build_policy
from kvforge.kv.policies.head_roles import HeadRoles, HeadScores

TOKENS = [int(t) for t in torch.randint(1, 90, (150,), generator=torch.Generator().manual_seed(3))]
SCORES = torch.tensor([[0.9, 0.1], [0.2, 0.05]])  # layer 0 head 0 retrieval; 0.1 and 0.05 streaming


def _engine(loaded, options: dict) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory=4_000_000, block_size=8, enable_prefix_caching=False,
                                  kv_policy="h2o", kv_policy_options=options), loaded)


def test_roles_replace_streaming_heads_rows():
    roles = HeadScores(SCORES, "copy-attention", "x", {}).roles(0.25, 0.5)
    assert roles.retrieval.tolist() == [[True, False], [False, False]]
    assert roles.streaming.tolist() == [[False, True], [False, True]]
    keep = torch.tensor([0, 2, 5, 7, 8, 9])
    by_score = torch.tensor([0, 1, 2, 3, 4, 5])
    out = roles.apply(keep, 12, by_score, sinks=2)
    assert out.shape == (2, 2, 6)
    assert out[0, 0].tolist() == by_score.tolist() and out[1, 0].tolist() == keep.tolist()
    assert out[0, 1].tolist() == [0, 1, 8, 9, 10, 11] and out[1, 1].tolist() == [0, 1, 8, 9, 10, 11]
    assert HeadRoles(torch.zeros(2, 2, dtype=torch.int8)).apply(keep[None, None].expand(2, 2, 6), 12).equal(
        keep.expand(2, 2, 6))


def test_engine_with_roles_frees_blocks_and_matches_the_dense_reference(peaky_loaded, tmp_path):
    path = HeadScores(SCORES, "copy-attention", "x", {}).save(tmp_path / "heads.json")
    options = {"budget": 0.5, "recent": 0.5, "slack": 8, "heads": str(path)}
    engine = _engine(peaky_loaded, options)
    nll, seen_blocks = [], []
    for start, logits in iter_chunk_logits(engine, TOKENS, 12):
        logp = torch.log_softmax(logits, -1)
        n = min(len(logits), len(TOKENS) - 1 - start)
        nll.append(-logp[torch.arange(n), torch.tensor(TOKENS[start + 1: start + 1 + n])].double())
        seen_blocks.append(engine.kv.allocator.num_used)
    assert engine.kv.allocator.num_used == 0  # every block back after the sequence
    assert engine.runner.evictor.compactions > 0
    assert seen_blocks[-1] <= blocks_for_tokens(int(0.5 * len(TOKENS)) + 8 + 12, 8) < blocks_for_tokens(len(TOKENS), 8)
    roles = HeadScores.load(path).roles(0.25, 0.5)
    sim = simulate(peaky_loaded.model, TOKENS, SimConfig(budget=0.5, recent=0.5, slack=8), chunk=12,
                   streaming=roles.streaming, retrieval=roles.retrieval)
    torch.testing.assert_close(torch.cat(nll), sim, atol=1e-3, rtol=1e-4)
    plain = simulate(peaky_loaded.model, TOKENS, SimConfig(budget=0.5, recent=0.5, slack=8), chunk=12)
    assert (sim - plain).abs().max() > 1e-2  # the roles changed what the streaming heads attend to


def test_heads_needs_per_head_scope():
    with pytest.raises(ConfigError, match="scope 'head'"):
        build_policy("h2o", {"heads": "auto", "scope": "layer"})
    with pytest.raises(ConfigError, match="at most 1"):
        build_policy("h2o", {"heads": "auto", "retrieval_heads": 0.6, "streaming_heads": 0.6})
