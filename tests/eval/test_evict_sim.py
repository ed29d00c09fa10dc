"""The dense eviction simulator: without sharing it is the engine's h2o (per layer and KV head); shared pools
choose heavy rows jointly as hand-computed."""
import math

import pytest
import torch

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.scoring import position_logits
from kvforge.errors import ConfigError
from kvforge.eval.evict_sim import SimConfig, select_shared, simulate

TOKENS = [int(t) for t in torch.randint(1, 90, (150,), generator=torch.Generator().manual_seed(3))]


def _engine_nll(loaded, options: dict, chunk: int) -> torch.Tensor:
    engine = LLMEngine(EngineConfig(kv_cache_memory=4_000_000, block_size=8, enable_prefix_caching=False,
                                    kv_policy="h2o", kv_policy_options=options), loaded)
    logp = torch.log_softmax(position_logits(engine, TOKENS, chunk_size=chunk), -1)
    assert engine.kv.allocator.num_used == 0
    return -logp[torch.arange(len(TOKENS) - 1), torch.tensor(TOKENS[1:])].double()


@pytest.mark.parametrize("query_heads", ["sum", "max"])
def test_unshared_simulation_is_the_engines_h2o(peaky_loaded, query_heads):
    cfg = SimConfig(budget=0.5, recent=0.5, slack=8, query_heads=query_heads)
    options = {"budget": 0.5, "recent": 0.5, "slack": 8, "query_heads": query_heads}
    sim = simulate(peaky_loaded.model, TOKENS, cfg, chunk=12)
    torch.testing.assert_close(sim, _engine_nll(peaky_loaded, options, 12), atol=1e-3, rtol=1e-4)
    full = simulate(peaky_loaded.model, TOKENS, SimConfig(budget=None), chunk=12)
    assert (sim - full).abs().max() > 1e-2  # eviction changed what was attended


def test_shared_pools_keep_the_same_total_and_differ_from_even_budgets(peaky_loaded):
    even = simulate(peaky_loaded.model, TOKENS, SimConfig(budget=0.5, slack=8), chunk=12)
    shared = simulate(peaky_loaded.model, TOKENS, SimConfig(budget=0.5, slack=8, share="layer", floor=0.0), chunk=12)
    assert (even - shared).abs().max() > 1e-2 and math.isfinite(shared.sum().item())


def test_select_shared_hand_computed():
    """Two heads, 6 rows, budget 3 each with 1 recent (row 5): 4 heavy slots. Even budgets (floor 1) keep each
    head's top two; one pool (floor 0) gives head 0's 5, 4, 3 and head 1's 0.9; floor 0.5 first gives each head
    its top one (5 and 0.9), then 4 and 3."""
    scores = torch.tensor([[5.0, 4.0, 3.0, 0.1, 0.2, 0.0], [0.9, 0.8, 0.7, 0.6, 0.5, 0.0]])
    alive = torch.ones(2, 6, dtype=torch.bool)
    rows = {floor: [k.nonzero()[:, 0].tolist() for k in select_shared(scores, alive, [3, 3], 0.34, floor)]
            for floor in (1.0, 0.0, 0.5)}
    assert rows == {1.0: [[0, 1, 5], [0, 1, 5]], 0.0: [[0, 1, 2, 5], [0, 5]], 0.5: [[0, 1, 2, 5], [0, 5]]}
    dead = alive.clone()
    dead[0, :3] = False  # evicted rows are never chosen again
    assert select_shared(scores, dead, [3, 3], 0.34, 0.0)[0, :3].sum() == 0


def test_pyramid_budgets_keep_the_total_and_bad_configs_are_refused():
    budgets = SimConfig(pyramid=0.5).layer_budgets(1000, 3)
    assert budgets == [750, 500, 250] and sum(budgets) == 3 * 500
    assert SimConfig(pyramid=-0.5).layer_budgets(1000, 3) == [250, 500, 750]
    for bad in ({"share": "block"}, {"pyramid": 1.0}, {"pyramid": -1.0}, {"budget": 2}, {"query_heads": "mean"}, {"floor": 1.5}):
        with pytest.raises(ConfigError):
            SimConfig(**bad)
