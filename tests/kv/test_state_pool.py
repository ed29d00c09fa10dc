"""The recurrent state pool: fixed slots, zeroed when taken, exact bytes; the one formula counts them per sequence."""
import pytest
import torch

from kvforge.kv.formats import get_format
from kvforge.kv.groups import StateGroup, build_groups, state_bytes_per_sequence
from kvforge.kv.memory import num_blocks_for_budget, pool_bytes, sequences_that_fit
from kvforge.kv.spec import KVCacheSpec
from kvforge.kv.state_pool import StatePool

MAMBA = StateGroup("mamba2", (0, 2, 3), (("conv", (3, 40)), ("ssm", (4, 8, 16))))


def test_slots_are_zeroed_when_taken_and_given_back_once():
    pool = StatePool([MAMBA], 2, torch.device("cpu"))
    a = pool.allocate()
    pool.layer(2)["ssm"][a].fill_(1.0)
    saved = pool.snapshot(a)
    b = pool.allocate()
    assert pool.allocate() is None and pool.num_used == 2
    pool.free(a)
    assert pool.allocate() == a and float(pool.layer(2)["ssm"][a].abs().sum()) == 0.0
    pool.restore(b, saved)
    assert torch.equal(pool.layer(2)["ssm"][b], torch.ones(4, 8, 16))
    pool.free(b)
    with pytest.raises(ValueError, match="not in use"):
        pool.free(b)


def test_a_slot_exported_is_imported_bit_exact_into_another():
    pool = StatePool([MAMBA], 2, torch.device("cpu"))
    a, b = pool.allocate(), pool.allocate()
    for layer in MAMBA.layers:
        for t in pool.layer(layer).values():
            t[a].copy_(torch.randn(t[a].shape))
    payload = pool.export_slot(a)
    assert len(payload) == pool.slot_bytes() == state_bytes_per_sequence([MAMBA])
    pool.import_slot(b, payload)
    assert all(torch.equal(t[a], t[b]) for layer in MAMBA.layers for t in pool.layer(layer).values())
    with pytest.raises(ValueError, match="does not fit"):
        pool.import_slot(b, payload[:-4])


def test_pool_bytes_are_the_formula():
    pool = StatePool([MAMBA], 5, torch.device("cpu"))
    per_seq = 3 * 4 * (3 * 40 + 4 * 8 * 16)
    assert state_bytes_per_sequence([MAMBA]) == per_seq == pool.slot_bytes()
    assert pool.allocated_bytes() == 5 * per_seq


def test_the_budget_holds_states_beside_blocks():
    spec, fmt = KVCacheSpec(1, 2, 16, 16), get_format("fp32")
    groups = build_groups([None])
    state = state_bytes_per_sequence([MAMBA])
    block = pool_bytes(spec, fmt, 16, 1, 0, groups)
    blocks = num_blocks_for_budget(spec, fmt, 16, 4 * state + 10 * block, 4, groups, state)
    assert blocks == 10
    assert pool_bytes(spec, fmt, 16, blocks, 4, groups, state) == 4 * state + 10 * block
    assert sequences_that_fit(spec, fmt, 16, 3 * (state + 2 * block), 32, groups, state) == 3


def test_a_model_without_attention_has_blocks_of_no_bytes():
    groups = build_groups([])
    spec, fmt = KVCacheSpec(0, 1, 1, 1), get_format("fp32")
    state = state_bytes_per_sequence([MAMBA])
    assert num_blocks_for_budget(spec, fmt, 16, 4 * state, 4, groups, state) == -1  # states fit; blocks are free
    assert num_blocks_for_budget(spec, fmt, 16, 4 * state - 1, 4, groups, state) == 0
