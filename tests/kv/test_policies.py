"""Selection functions of the KV policies: which cache indices each one keeps."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.errors import ConfigError
from kvforge.kv.policies import PolicyState, SequenceView, build_policy
from kvforge.kv.policies.base import top_with_recent


def _seq(cache_len: int, computed: int | None = None, prompt_len: int = 0, state=None):
    computed = cache_len if computed is None else computed
    return SequenceView(cache_len, computed, prompt_len, state if state is not None else PolicyState())


def test_window_keeps_most_recent():
    p = build_policy("window", {"budget": 5, "slack": 2})
    assert p.keep(_seq(7)) is None  # within budget + slack
    assert p.keep(_seq(8)).tolist() == [3, 4, 5, 6, 7]


def test_streaming_keeps_sinks_and_recent():
    p = build_policy("streaming", {"budget": 8, "sinks": 3, "slack": 0})
    assert p.keep(_seq(12)).tolist() == [0, 1, 2, 7, 8, 9, 10, 11]
    assert build_policy("streaming", {"budget": 8, "sinks": 0, "slack": 0}).select(12, 8, PolicyState()).tolist() \
        == list(range(4, 12))


def test_h2o_keeps_heavy_hitters_and_recent():
    p = build_policy("h2o", {"budget": 4, "recent": 2, "slack": 0})
    state = PolicyState()
    attn = torch.tensor([[0.1, 0.5, 0.0, 0.1, 0.3, 0.0, 0.0], [0.0, 0.2, 0.0, 0.6, 0.1, 0.1, 0.0]])
    p.observe(state, attn)
    assert torch.allclose(state.scores, attn.sum(0))
    assert p.keep(_seq(7, state=state)).tolist() == [1, 3, 5, 6]  # 1 and 3 are heavy, 5 and 6 recent


def test_h2o_mean_score_does_not_favour_age_and_sinks_stay():
    """Token 1 gathers more attention in sum (over 5 queries) than token 4 (over 2), token 4 more per query."""
    attn = torch.tensor([[1.0, 0, 0, 0, 0, 0], [0.7, 0.3, 0, 0, 0, 0], [0.5, 0.3, 0.2, 0, 0, 0],
                         [0.5, 0.3, 0.1, 0.1, 0, 0], [0.0, 0.3, 0.0, 0.0, 0.7, 0], [0.1, 0.3, 0.0, 0.0, 0.5, 0.1]])
    picks = {}
    for score in ("sum", "mean"):
        p, state = build_policy("h2o", {"budget": 3, "recent": 1, "slack": 0, "score": score}), PolicyState()
        p.observe(state, attn)
        picks[score] = p.keep(_seq(6, state=state)).tolist()
    assert picks == {"sum": [0, 1, 5], "mean": [0, 4, 5]}
    assert build_policy("h2o", {"budget": 3, "recent": 1, "sinks": 2, "slack": 0}).select(6, 3, state).tolist() == [0, 1, 5]


def test_h2o_decay_weighs_older_attention_less():
    p, state = build_policy("h2o", {"budget": 2, "recent": 1, "slack": 0, "decay": 0.5, "scope": "sequence"}), PolicyState()
    first, second = torch.tensor([[0.9, 0.1, 0.0]]), torch.tensor([[0.2, 0.3, 0.5], [0.1, 0.6, 0.3]])
    p.observe(state, first)
    p.observe(state, second)
    assert torch.allclose(state.scores, first[0] * 0.25 + second.sum(0))
    assert p.keep(_seq(3, state=state)).tolist() == [1, 2]  # token 0 led once, token 1 leads lately


def test_h2o_pool_keeps_the_neighbours_of_a_heavy_hitter():
    """Scores [0, 0, .6, 0, 0, .1, .3 | 0]: alone the heavy three are 2, 5, 6; max-pooled over 3 indices they are
    [0, .6, .6, .6, .1, .3, .3], so 1, 2, 3 (the hitter and its neighbours) are kept."""
    attn = torch.tensor([[0.0, 0.0, 0.6, 0.0, 0.0, 0.1, 0.3, 0.0]])
    picks = {}
    for pool in (1, 3):
        p, state = build_policy("h2o", {"budget": 4, "recent": 1, "slack": 0, "pool": pool, "scope": "sequence"}), PolicyState()
        p.observe(state, attn)
        picks[pool] = p.keep(_seq(8, state=state)).tolist()
    assert picks == {1: [2, 5, 6, 7], 3: [1, 2, 3, 7]}


def test_scissorhands_counts_persistent_importance():
    p = build_policy("scissorhands", {"budget": 3, "recent": 1, "slack": 0, "history": 2})
    state = PolicyState()
    # 4 keys, rows see 3 then 4 keys; threshold is 1/visible
    p.observe(state, torch.tensor([[0.2, 0.7, 0.1, 0.0], [0.6, 0.3, 0.05, 0.05]]))
    assert state.history.tolist() == [[0, 1, 0, 0], [1, 1, 0, 0]]
    p.observe(state, torch.tensor([[0.5, 0.05, 0.4, 0.05]]))  # history 2: the first row falls out
    assert state.history.tolist() == [[1, 1, 0, 0], [1, 0, 1, 0]]
    assert p.keep(_seq(4, state=state)).tolist() == [0, 2, 3]  # 0 persisted; 1 and 2 tie, the newer wins; 3 is recent


def test_snapkv_pools_votes_of_the_window_once():
    p = build_policy("snapkv", {"budget": 4, "window": 2, "kernel": 3, "pooling": "max"})
    state = PolicyState()
    seq = _seq(10, prompt_len=10, state=state)
    assert p.attention_rows(_seq(0, prompt_len=10, state=state), 10) == 2
    assert p.attention_rows(_seq(0, prompt_len=20, state=state), 10) == 0  # the chunk does not end the prompt
    votes = torch.zeros(2, 10)
    votes[0, 3] = 1.0  # pooled with kernel 3: 2, 3, 4 tie at 1
    votes[1, 8] = votes[1, 9] = 0.5
    p.observe(state, votes)
    keep = p.keep(seq)
    assert len(keep) == 4 and keep[-2:].tolist() == [8, 9] and set(keep[:2].tolist()) <= {2, 3, 4}
    assert p.attention_rows(seq, 1) == 0 and p.keep(_seq(11, prompt_len=10, state=state)) is None


def test_drops_come_in_whole_units_within_budget_plus_slack():
    """window, budget 100, slack 16: at 117 rows one unit of 16 goes (101 kept, the next 16 shift by a block); at
    140, 32; with slack 4 a whole unit would leave more than budget + slack, so exactly the budget stays."""
    p = build_policy("window", {"budget": 100, "slack": 16})
    assert p.keep(_seq(117), drop_unit=16).tolist() == list(range(16, 117))
    assert len(p.keep(_seq(140), drop_unit=16)) == 108 and len(p.keep(_seq(140))) == 100
    tight = build_policy("window", {"budget": 100, "slack": 4})
    assert len(tight.keep(_seq(110), drop_unit=16)) == 100


def test_formats_name_their_drop_unit():
    """Per-channel keys share a block's parameters: their compactions drop whole blocks; per-token formats move
    rows one by one as stored."""
    from kvforge.kv.formats import get_format
    from kvforge.kv.spec import KVCacheSpec
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=64, v_head_dim=64)
    units = {name: get_format(name).drop_unit(spec, 16) for name in ("fp32", "fp16", "int8", "fp8_e4m3", "int4", "kivi2")}
    assert units == {"fp32": 1, "fp16": 1, "int8": 1, "fp8_e4m3": 1, "int4": 16, "kivi2": 16}
    assert get_format("int4", key_axis="token", window=0).drop_unit(spec, 16) == 1


def test_fraction_budget_follows_length():
    p = build_policy("h2o", {"budget": 0.5, "slack": 0})
    assert p.budget_for(100) == 50 and p.budget_for(3) == 1


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 80), st.integers(1, 80), st.integers(0, 80), st.integers(0, 2**31))
def test_top_with_recent_is_sorted_unique_and_has_recent(length, budget, num_recent, seed):
    scores = torch.rand(length, generator=torch.Generator().manual_seed(seed))
    keep = top_with_recent(scores, budget, num_recent)
    assert keep.tolist() == sorted(set(keep.tolist())) and len(keep) == min(budget, length)
    r = min(num_recent, budget, length)
    assert set(range(length - r, length)) <= set(keep.tolist())
    if budget < length:
        heavy = [i for i in keep.tolist() if i < length - r]
        others = [i for i in range(length - r) if i not in heavy]
        assert not heavy or not others or scores[heavy].min() >= scores[others].max()


@pytest.mark.parametrize("name,options", [("streaming", {"budget": 0.5}), ("streaming", {"budget": 4, "sinks": 4}),
                                          ("h2o", {"budget": 0}), ("h2o", {"budget": 4, "score": "max"}),
                                          ("h2o", {"budget": 4, "decay": 0}), ("h2o", {"budget": 4, "scope": "block"}),
                                          ("snapkv", {"budget": 4, "scope": "head"}),
                                          ("h2o", {"budget": 4, "weight": "values"}),
                                          ("h2o", {"budget": 4, "weight": "value", "scope": "layer"}),
                                          ("scissorhands", {"budget": 4, "weight": "value", "scope": "sequence"}),
                                          ("scissorhands", {"budget": 4, "weight": 1}),
                                          ("h2o", {"budget": 4, "pool": 2}), ("h2o", {"budget": 4, "pool": 0}),
                                          ("h2o", {"budget": 4, "query_heads": "mean"}),
                                          ("scissorhands", {"budget": 4, "query_heads": 3}),
                                          ("window", {"budget": 1.5}),
                                          ("snapkv", {"budget": 8, "kernel": 4}), ("window", {"budget": 8, "bogus": 1})])
def test_bad_options_are_config_errors(name, options):
    with pytest.raises(ConfigError):
        build_policy(name, options)


def test_default_policy_is_full():
    assert build_policy(None).name == "full" and not build_policy(None).evicts


def test_keydiff_keeps_the_keys_least_like_the_mean():
    """Four keys along one direction and two off it: the two off it stay, with the newest (recent 1)."""
    p = build_policy("keydiff", {"budget": 3, "recent": 1, "sinks": 0, "slack": 0})
    keys = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [1.0, 0.0], [-1.0, 0.2], [1.0, 0.05]])
    state = PolicyState(keys=keys[None, None])  # [layers, heads, keys, dim]
    assert p.keep(_seq(6, state=state)).tolist() == [[[2, 4, 5]]]
    two_heads = PolicyState(keys=torch.stack([keys, keys.flip(0)])[None])  # head 1 sees the keys reversed
    assert p.keep(_seq(6, state=two_heads)).tolist() == [[[2, 4, 5], [1, 3, 5]]]


def test_keydiff_without_keys_is_an_error_and_options_are_checked():
    with pytest.raises(ValueError, match="PolicyState.keys"):
        build_policy("keydiff", {"budget": 2, "slack": 0}).keep(_seq(4))
    with pytest.raises(ConfigError, match="recent"):
        build_policy("keydiff", {"budget": 2, "recent": 1.5})
    with pytest.raises(ConfigError, match="scope"):
        build_policy("keydiff", {"budget": 2, "scope": "sequence"})


def test_tova_ranks_by_the_newest_query_only():
    """Token 1 had the most attention earlier; the newest query ignores it, so it goes."""
    p, state = build_policy("tova", {"budget": 3, "slack": 0, "sinks": 0}), PolicyState()
    p.observe(state, torch.tensor([[[[0.1, 0.8, 0.1, 0.0, 0.0]]]]))
    p.observe(state, torch.tensor([[[[0.2, 0.0, 0.3, 0.1, 0.4], [0.4, 0.0, 0.3, 0.1, 0.2]]]]))  # two rows: the last counts
    assert p.keep(_seq(5, state=state)).tolist() == [[[0, 2, 4]]]
    assert build_policy("tova", {"budget": 3, "slack": 0, "sinks": 1, "recent": 0}).keep(_seq(5, state=state)).tolist() \
        == [[[0, 2, 4]]]
    with pytest.raises(ConfigError, match="sinks"):
        build_policy("tova", {"budget": 3, "sinks": -1})


def _turn(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [..., d] by angle [d / 2] (one pair per frequency)."""
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], dim=-1)


@pytest.mark.parametrize("covariance,query_heads", [(False, "mean"), (True, "mean"), (True, "max")])
def test_expected_attention_matches_an_explicit_gaussian_estimate(covariance, query_heads):
    """Each recent query turned to every future position one by one, averaged, its covariance written out."""
    from kvforge.kv.policies.expected_attention import expected_attention

    g = torch.Generator().manual_seed(0)
    queries, keys = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    positions, inv_freq, future = torch.tensor([5, 6, 7]), torch.tensor([1.0, 0.3, 0.1, 0.01]), 4
    turned = torch.stack([torch.stack([_turn(queries[:, :, i], (8 + j - positions[i]) * inv_freq) for j in range(future)]).mean(0)
                          for i in range(3)], dim=2)  # [1, 4, 3, 8]
    mean = turned.mean(2)
    logits = torch.einsum("lhnd,lhd->lhn", keys.repeat_interleave(2, 1), mean) / 8 ** 0.5
    if covariance:
        cov = torch.stack([torch.cov(turned[0, h].T) for h in range(4)])  # [4, 8, 8]
        k = keys.repeat_interleave(2, 1)[0]
        logits = logits + torch.einsum("hnd,hde,hne->hn", k, cov, k)[None] / 16
    by_kv_head = torch.softmax(logits, -1).unflatten(1, (2, 2))
    want = by_kv_head.amax(2) if query_heads == "max" else by_kv_head.mean(2)
    got = expected_attention(queries, positions, inv_freq, keys, future, covariance, query_heads)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_expected_attention_keeps_what_the_expected_query_needs_and_checks_options():
    p = build_policy("expected_attention", {"budget": 3, "slack": 0, "sinks": 0, "recent": 1, "covariance": False})
    keys = torch.zeros(1, 1, 6, 2)
    keys[0, 0, :, 0] = torch.tensor([0.0, 5.0, -5.0, 4.0, 0.0, 0.0])  # queries point along +x, which turns little
    state = PolicyState(keys=keys, values=torch.ones(1, 1, 6))
    p.observe_queries(state, torch.tensor([[[[1.0, 0.0]]]]), torch.tensor([5]), torch.tensor([1e-4]))
    assert p.keep(_seq(6, state=state)).tolist() == [[[1, 3, 5]]]
    state.values = torch.tensor([[[0.9, 0.01, 1.0, 1.0, 1.0, 1.0]]])  # key 1 carries almost nothing
    assert p.keep(_seq(6, state=state)).tolist() == [[[3, 4, 5]]]
    alone = build_policy("expected_attention", {"budget": 3, "slack": 0, "sinks": 0, "recent": 1, "covariance": False,
                                                "value_power": 0.0})
    assert alone.keep(_seq(6, state=state)).tolist() == [[[1, 3, 5]]]  # expected attention alone
    with pytest.raises(ConfigError, match="window"):
        build_policy("expected_attention", {"budget": 0.5, "window": 0})
    for bad in ({"query_heads": "sum"}, {"value_power": -1}, {"placement": "sorted"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            build_policy("expected_attention", {"budget": 0.5, **bad})


def test_expected_attention_tells_sinks_and_recent_by_position_not_cache_index():
    """Rows placed in place are out of order: with each row's logical position, the kept set is the same tokens as
    for the rows in order (top_with_recent), and row_positions continues the recorded positions with the newest."""
    from kvforge.kv.policies.base import top_with_recent
    from kvforge.kv.policies.expected_attention import row_positions, top_with_newest

    g = torch.Generator().manual_seed(3)
    scores = torch.rand(2, 3, 40, generator=g)
    want = top_with_recent(scores, 20, 6, 4)
    assert torch.equal(top_with_newest(scores, torch.arange(40), 20, 6, 4), want)
    perm = torch.stack([torch.stack([torch.randperm(40, generator=g) for _ in range(3)]) for _ in range(2)])
    got = top_with_newest(scores.gather(-1, perm), perm, 20, 6, 4)
    assert torch.equal(perm.gather(-1, got).sort(-1).values, want)
    known = torch.tensor([[0, 1, 9, 3]])
    assert row_positions(known, 7, 20).tolist() == [[0, 1, 9, 3, 17, 18, 19]]
    assert row_positions(None, 3, 3).tolist() == [0, 1, 2]


def test_expected_attention_memory_keeps_the_larger_of_the_new_and_the_decayed_previous_score():
    from kvforge.kv.policies.expected_attention import carry_scores

    scores = torch.tensor([[[0.1, 0.4, 0.2, 0.3]]])
    previous = torch.tensor([[[2.0, 1.0, 1.0]]])  # rows 0-2 were kept last time; row 3 is new
    got = carry_scores(scores, previous, 0.5)  # previous rescaled to scores' total over rows 0-2 (0.7): 0.35, .175, .175
    torch.testing.assert_close(got, torch.tensor([[[0.175, 0.4, 0.2, 0.3]]]))
    assert torch.equal(carry_scores(scores, torch.zeros(0), 0.5), scores)  # nothing kept before
    with pytest.raises(ConfigError, match="memory"):
        build_policy("expected_attention", {"budget": 0.5, "memory": 1.5})
