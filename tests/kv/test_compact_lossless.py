"""Compaction moves quantized rows as stored: kept rows decode to the same values before and after."""
import pytest
import torch

from kvforge.kv.formats import get_format
from kvforge.kv.spec import KVCacheSpec

SPEC = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=32, v_head_dim=32)
BS, BLOCKS, ROWS = 16, 12, 150
FORMATS = [("int8", {}), ("fp8_e4m3", {"sinks": 4, "window": 0}), ("fp8_e4m3", {}), ("int4", {"group_size": 16}),
           ("int4", {"group_size": 16, "key_axis": "token"}), ("kivi2", {"group_size": 16, "window": 32}),
           ("int4", {"group_size": 16, "window": 32, "outlier_frac": 0.02})]


def filled(name: str, options: dict):
    """One sequence of ROWS rows in blocks 11, 10, ... (a scattered table), written 16 rows at a time as the
    engine does, keys with outlier channels so per-channel and per-token grids differ."""
    layer = get_format(name, **options).allocate(SPEC, BLOCKS, BS, torch.device("cpu"), max_num_seqs=1)
    table = torch.arange(BLOCKS - 1, -1, -1)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(ROWS, 2, 32, generator=gen) * torch.linspace(0.2, 6.0, 32)
    v = torch.randn(ROWS, 2, 32, generator=gen)
    for start in range(0, ROWS, BS):
        idx = torch.arange(start, min(start + BS, ROWS))
        layer.write(slots(table, idx), k[idx], v[idx], positions=idx)
    return layer, table


def slots(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return table[idx // BS] * BS + idx % BS


def compacted(name: str, options: dict, keep: torch.Tensor):
    """Decoded kept rows before the move, and the rows at their new indices after it."""
    layer, table = filled(name, options)
    before = layer.read_rows(slots(table, keep), BS)
    index = torch.arange(len(keep))
    moved = keep != index
    layer.move(slots(table, keep[moved]), slots(table, index[moved]), BS)
    return before, layer.read_rows(slots(table, index), BS)


def streaming_keep(sinks: int = 4, dropped: int = 2 * BS) -> torch.Tensor:
    return torch.cat([torch.arange(sinks), torch.arange(sinks + dropped, ROWS)])


def scattered(seed: int, sinks: int = 4) -> torch.Tensor:
    rest = torch.randperm(ROWS - sinks, generator=torch.Generator().manual_seed(seed))[:70] + sinks
    return torch.cat([torch.arange(sinks), torch.sort(rest).values])


@pytest.mark.parametrize("name,options", FORMATS)
def test_streaming_compaction_is_lossless(name, options):
    """Sinks stay, the recent rows shift by whole blocks: every kept row decodes bit for bit as before,
    per-channel key groups included (their blocks move whole)."""
    before, after = compacted(name, options, streaming_keep())
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


@pytest.mark.parametrize("name,options", [("int8", {}), ("fp8_e4m3", {"sinks": 4, "window": 0}),
                                          ("int4", {"group_size": 16, "key_axis": "token", "window": 0})])
def test_scattered_compaction_of_per_token_rows_is_lossless(name, options):
    """H2O-style keep sets (the sinks and rows from anywhere): rows stored per token move slot by slot,
    unchanged. (A row moved under a sink entry, when a policy drops a sink, is held there in fp16.)"""
    keep = scattered(seed=1)
    before, after = compacted(name, options, keep)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_scattered_rows_into_a_staged_block_keep_their_fp16_value():
    """With an fp16 window, rows that land in a staged block are held as the fp16 of what they decoded to;
    every other row keeps its codes."""
    before, after = compacted("fp8_e4m3", {"window": 16}, scattered(seed=3))
    for b, a in zip(before, after):
        assert torch.equal(b.half().float(), a.half().float())
        assert torch.equal(a[: -2 * BS], b[: -2 * BS])


def test_regrouped_per_channel_keys_are_encoded_once():
    """A keep set that mixes blocks re-groups per-channel keys (one encoding of their decoded values);
    values, stored per token, stay exact, and the keys stay within one quantization step."""
    keep = scattered(seed=2)
    before, after = compacted("int4", {"group_size": 16}, keep)
    assert not torch.equal(before[0], after[0])
    err = (before[0] - after[0]).abs()
    span = before[0].amax(0) - before[0].amin(0)
    assert bool((err <= span / 15 + 1e-4).all())


def test_old_path_rounds_twice():
    """The re-encoding the move replaces (decode, write again) changes per-channel keys: the test above
    would catch a move that fell back to it."""
    layer, table = filled("int4", {"group_size": 16})
    keep = streaming_keep(dropped=BS + 5)
    index = torch.arange(len(keep))
    moved = keep != index
    before = layer.read_rows(slots(table, keep), BS)
    k, v = layer.read_rows(slots(table, keep[moved]), BS)
    layer.write(slots(table, index[moved]), k, v)
    after = layer.read_rows(slots(table, index), BS)
    assert not torch.equal(before[0], after[0])
