"""Kept sets per layer and KV head: each keeps its own top scores, and compaction moves each head's rows as stored."""
import pytest
import torch

from kvforge.kv.formats import get_format
from kvforge.kv.policies import PolicyState, SequenceView, build_policy
from kvforge.kv.policies.base import top_with_recent
from kvforge.kv.policies.stats import AttentionStats, record_prefill
from kvforge.kv.spec import KVCacheSpec

LAYERS, HEADS, LENGTH = 3, 2, 40
SPEC = KVCacheSpec(num_layers=1, num_kv_heads=HEADS, head_dim=32, v_head_dim=32)
BS, BLOCKS, ROWS = 16, 12, 150


def _attn(rows: int, seed: int) -> torch.Tensor:
    a = torch.rand(LAYERS, HEADS, rows, LENGTH, generator=torch.Generator().manual_seed(seed)) ** 4
    return a / a.sum(-1, keepdim=True)


@pytest.mark.parametrize("name", ["h2o", "scissorhands"])
def test_each_layer_and_head_keeps_its_own_top_scores(name):
    policy = build_policy(name, {"budget": 16, "recent": 4, "sinks": 2, "slack": 0})
    state = PolicyState()
    attn = _attn(8, seed=1)
    policy.observe(state, attn)
    keep = policy.keep(SequenceView(LENGTH, LENGTH, 0, state))
    assert keep.shape == (LAYERS, HEADS, 16)
    for layer in range(LAYERS):
        for head in range(HEADS):
            if name == "h2o":
                expected = top_with_recent(attn[layer, head].sum(0), 16, 4, sinks=2)
            else:
                one = build_policy(name, {"budget": 16, "recent": 4, "sinks": 2, "slack": 0, "scope": "sequence"})
                alone = PolicyState()
                one.observe(alone, attn[layer, head])
                expected = one.select(LENGTH, 16, alone)
            assert keep[layer, head].tolist() == expected.tolist()
    assert len({tuple(k.tolist()) for k in keep.flatten(0, 1)}) > 1  # the sets really differ
    state.compact(keep)  # statistics follow each layer's and head's own rows
    if name == "h2o":
        assert torch.equal(state.scores, attn.sum(2).gather(-1, keep))


def test_layer_scope_sums_heads_and_settled_queries_count_for_mean():
    """A first row standing for several queries (summed on arrival) gives the same scores and counts as the rows."""
    attn = _attn(6, seed=2).sum(1, keepdim=True)
    whole, summed = PolicyState(), PolicyState()
    policy = build_policy("h2o", {"budget": 16, "scope": "layer", "score": "mean", "slack": 0})
    policy.observe(whole, attn)
    policy.observe(summed, torch.cat([attn[:, :, :4].sum(2, keepdim=True), attn[:, :, 4:]], 2), queries=6)
    assert torch.allclose(whole.scores, summed.scores) and torch.equal(whole.seen, summed.seen)
    assert policy.keep(SequenceView(LENGTH, LENGTH, 0, whole)).shape == (LAYERS, 1, 16)


def test_value_weight_multiplies_scores_by_value_norms():
    """One layer, one head, 4 rows; hand-computed: H2O sums [1.0, 0.6, 0.4, 0] times |v| [0.1, 1, 2, 1]
    = [0.1, 0.6, 0.8, 0]: with one heavy slot and one recent, row 2 (not row 0, the sink) is kept."""
    attn = torch.tensor([[0.6, 0.4, 0.0, 0.0], [0.4, 0.2, 0.4, 0.0]])[None, None]
    norms = torch.tensor([0.1, 1.0, 2.0, 1.0])[None, None]
    picks = {}
    for weight in ("attention", "value"):
        policy, state = build_policy("h2o", {"budget": 2, "recent": 1, "slack": 0, "weight": weight}), PolicyState()
        state.set_values(0, norms)
        policy.observe(state, attn)
        picks[weight] = policy.keep(SequenceView(4, 4, 0, state))[0, 0].tolist()
    assert picks == {"attention": [0, 3], "value": [2, 3]}
    state.compact(torch.tensor([[[2, 3]]]))
    assert state.values.tolist() == [[[2.0, 1.0]]]


def test_value_weight_scissorhands_counts_rows_above_the_uniform_share_of_output_mass():
    """One query over 3 keys: attention x |v| = [0.05, 0.4, 0.6], uniform share 1.05 / 3 = 0.35: keys 1 and 2
    count; by attention alone (share 1/3) only key 0 does."""
    attn = torch.tensor([[0.5, 0.2, 0.3]])[None, None]
    for weight, counted in (("attention", [1, 0, 0]), ("value", [0, 1, 1])):
        policy, state = build_policy("scissorhands", {"budget": 2, "slack": 0, "weight": weight}), PolicyState()
        state.set_values(0, torch.tensor([0.1, 2.0, 2.0])[None, None])
        policy.observe(state, attn)
        assert state.history[0, 0, 0].tolist() == [bool(c) for c in counted]


def test_set_values_replaces_rows_from_start_and_drops_later_ones():
    state = PolicyState()
    state.set_values(0, torch.ones(1, 2, 5))
    state.set_values(3, torch.full((1, 2, 1), 7.0))  # rows 3, 4 rolled back; row 3 rewritten
    assert state.values[0, 0].tolist() == [1.0, 1.0, 1.0, 7.0] and state.values_known(10) == 4


def _filled(name: str, options: dict):
    layer = get_format(name, **options).allocate(SPEC, BLOCKS, BS, torch.device("cpu"), max_num_seqs=1)
    table = torch.arange(BLOCKS - 1, -1, -1)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(ROWS, HEADS, 32, generator=gen) * torch.linspace(0.2, 6.0, 32)
    v = torch.randn(ROWS, HEADS, 32, generator=gen)
    for start in range(0, ROWS, BS):
        idx = torch.arange(start, min(start + BS, ROWS))
        layer.write(_slots(table, idx), k[idx], v[idx], positions=idx)
    return layer, table


def _slots(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return table[idx // BS] * BS + idx % BS


def _per_head_keep() -> torch.Tensor:
    """[HEADS, 70]: the first 4 rows and a different scattered choice per head."""
    out = []
    for h in range(HEADS):
        rest = torch.randperm(ROWS - 4, generator=torch.Generator().manual_seed(10 + h))[:66] + 4
        out.append(torch.cat([torch.arange(4), torch.sort(rest).values]))
    return torch.stack(out)


def _moved(name: str, options: dict):
    """Each head's kept rows decoded before the move, and the rows at indices 0..m-1 after it."""
    layer, table = _filled(name, options)
    keep = _per_head_keep()
    before = [torch.stack([x[keep[h], h] for h in range(HEADS)], 1) for x in layer.read_rows(_slots(table, torch.arange(ROWS)), BS)]
    index = torch.arange(keep.shape[1])
    moved = (keep != index).any(0)
    layer.move_heads(_slots(table, keep[:, moved].T), _slots(table, index[moved]), BS)
    return before, layer.read_rows(_slots(table, index), BS)


@pytest.mark.parametrize("name,options", [("fp32", {}), ("fp16", {}), ("int8", {}), ("fp8_e4m3", {"sinks": 4, "window": 0}),
                                          ("int4", {"group_size": 16, "key_axis": "token", "window": 0})])
def test_per_head_move_of_per_token_rows_is_bit_exact(name, options):
    before, after = _moved(name, options)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_per_head_move_keeps_values_exact_and_regroups_per_channel_keys_once():
    """int4 defaults (keys per channel, fp16 window): values stored per token move exactly (or as the fp16 of
    what they decoded to, in the window's blocks); keys re-grouped per channel stay within one step."""
    before, after = _moved("int4", {"group_size": 16})
    assert torch.equal(before[1].half().float(), after[1].half().float())
    assert torch.equal(before[1][: -2 * BS], after[1][: -2 * BS])
    span = before[0].amax(0) - before[0].amin(0)
    assert bool(((before[0] - after[0]).abs() <= span / 15 + 1e-4).all())


def _one_kv_head_of_three_query_heads(query_heads: str) -> torch.Tensor:
    """record_prefill over 3 keys (one-hot, so head h's softmax is exp(q_h)): head 0 puts 0.9 on key 0, heads 1
    and 2 put 0.5 / 0.45 on keys 1 / 2 (0.05 elsewhere). Returns the row H2O sees: [1, 1, 1, 3]."""
    probs = torch.tensor([[0.9, 0.05, 0.05], [0.05, 0.5, 0.45], [0.05, 0.5, 0.45]])
    stats = AttentionStats({0: 1}, per_layer=True, query_heads=query_heads)
    record_prefill(stats, 0, probs.log()[None], torch.eye(3)[None, None], torch.ones(1, 3, dtype=torch.bool), 1.0)
    return stats.layer_attention(0)[0]


def test_query_heads_max_keeps_the_key_one_query_head_needs():
    """Hand-computed: sum over the three heads = [1.0, 1.05, 0.95] / 3, so H2O's one heavy slot (key 2 is the
    recent one) takes key 1; max = [0.9, 0.5, 0.45] / 1.85, so it takes key 0, which only head 0 attends."""
    summed, maxed = _one_kv_head_of_three_query_heads("sum"), _one_kv_head_of_three_query_heads("max")
    torch.testing.assert_close(summed[0, 0, 0], torch.tensor([1.0, 1.05, 0.95]) / 3)
    torch.testing.assert_close(maxed[0, 0, 0], torch.tensor([0.9, 0.5, 0.45]) / 1.85)
    for attn, kept in ((summed, [1, 2]), (maxed, [0, 2])):
        policy, state = build_policy("h2o", {"budget": 2, "recent": 1, "slack": 0}), PolicyState()
        policy.observe(state, attn)
        assert policy.keep(SequenceView(3, 3, 0, state))[0, 0].tolist() == kept
