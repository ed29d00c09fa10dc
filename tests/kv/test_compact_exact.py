"""Compaction under an fp16 window and per-head keep sets: what each kept row reads back, exactly.

A row read from a staging entry has no codes yet (its block is encoded when it leaves the window), so when it moves
into a block outside the window it is encoded once from its fp16 row; a row stored as codes keeps them. Per-head
moves keep a block's per-channel key groups for every head whose rows come whole from one block."""
import torch

from kvforge.kv.formats import get_format
from kvforge.kv.policies.compact import rows_to_write
from kvforge.kv.spec import KVCacheSpec

HEADS, DIM, BS, BLOCKS, ROWS = 2, 32, 16, 12, 150
SPEC = KVCacheSpec(num_layers=1, num_kv_heads=HEADS, head_dim=DIM, v_head_dim=DIM)
TABLE = torch.arange(BLOCKS - 1, -1, -1)  # a scattered block table


def slots(idx: torch.Tensor) -> torch.Tensor:
    return TABLE[idx // BS] * BS + idx % BS


def window(layer, rows: int) -> None:
    """The fp16 window of a sequence of `rows` rows (int4's default 16 tokens: the block being filled and the one
    before), as the KV manager marks it; blocks leaving it keep their entries until a claim takes them."""
    last = (rows - 1) // BS
    layer.may_stage.zero_()
    layer.may_stage[TABLE[max(0, last - 1): last + 1]] = True


def filled(options: dict | None = None):
    """ROWS rows written a block at a time, the window following them; keys with outlier channels."""
    layer = get_format("int4", group_size=16, **(options or {})).allocate(SPEC, BLOCKS, BS, torch.device("cpu"), 1)
    layer.may_stage = torch.zeros(BLOCKS, dtype=torch.bool)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(ROWS, HEADS, DIM, generator=gen) * torch.linspace(0.2, 6.0, DIM) + 1.0
    v = torch.randn(ROWS, HEADS, DIM, generator=gen)
    for start in range(0, ROWS, BS):
        idx = torch.arange(start, min(start + BS, ROWS))
        window(layer, int(idx[-1]) + 1)
        layer.unstage(TABLE[~layer.may_stage[TABLE]])
        layer.write(slots(idx), k[idx], v[idx], positions=idx)
    return layer


def staged(layer, idx: torch.Tensor) -> torch.Tensor:
    return layer.stage.lookup(slots(idx) // BS) >= 0


def test_values_from_the_window_are_encoded_where_they_land():
    """21 rows dropped in front: the staged blocks' rows (128-149) shift to 107-128, the first five below the new
    window (blocks 7-8), into a block of codes. There their values must read as their fp16 rows encoded once, never
    as the stale codes their source slots hold; every other row reads as before."""
    layer = filled()
    gen = torch.Generator().manual_seed(1)
    dropped = torch.randperm(96, generator=gen)[:21] + 4
    keep = torch.tensor([i for i in range(ROWS) if i not in set(dropped.tolist())])
    index = torch.arange(len(keep))
    from_window = staged(layer, keep)
    before = layer.read_rows(slots(keep), BS)
    window(layer, len(keep))
    moved = keep != index
    layer.move(slots(keep[moved]), slots(index[moved]), BS)
    after = layer.read_rows(slots(index), BS)
    into_codes = from_window & ~staged(layer, index)
    assert int(into_codes.sum()) == 5  # the case the test is about occurs
    codec = layer.codecs[1]
    block = torch.zeros(1, BS, HEADS, DIM)  # the rows at their offsets in a block, as the move encodes them
    offsets = index[into_codes] % BS
    block[0, offsets] = before[1][into_codes]
    assert torch.equal(after[1][into_codes], codec.decode(codec.encode(block))[0, offsets])
    assert torch.equal(after[1][~into_codes], before[1][~into_codes])


def test_per_head_moves_keep_whole_key_blocks_and_still_heads():
    """Head 0 drops 32 rows in the middle, head 1 none of its first 96: head 0's rows past its drop shift by two
    whole blocks and head 1 keeps every row it had below 96, so all those keys read back bit for bit (values below
    the new window always do); only head 0's block with the drop in it is encoded again."""
    layer = filled()
    m = ROWS - 32
    head0 = torch.cat([torch.arange(40), torch.arange(72, ROWS)])
    head1 = torch.cat([torch.arange(96), torch.arange(96, ROWS)[torch.randperm(ROWS - 96,
                       generator=torch.Generator().manual_seed(2))[: m - 96].sort().values]])
    keep = torch.stack([head0, head1], 1)  # [m, heads]
    index = torch.arange(m)
    before = layer.read_head_rows(slots(keep), BS)
    window(layer, m)
    moved = (keep != index[:, None]).any(1)
    layer.move_heads(slots(keep[moved]), slots(index[moved]), BS)
    after = layer.read_rows(slots(index), BS)
    assert torch.equal(after[1][:96], before[1][:96])
    assert torch.equal(after[1][96:], before[1][96:].half().float())  # the new window holds fp16 rows
    exact = torch.zeros(m, HEADS, dtype=torch.bool)
    exact[48:96, 0] = True  # head 0: blocks 3-5 come whole from blocks 5-7 (8 and 9 were the window)
    exact[:96, 1] = True
    assert torch.equal(after[0][exact], before[0][exact])
    assert not torch.equal(after[0][32:48, 0], before[0][32:48, 0])  # the block with the drop is encoded again
    assert bool(((after[0] - before[0]).abs() <= (before[0].amax(0) - before[0].amin(0)) / 15 + 1e-4).all())


def test_repeated_whole_block_drops_do_not_drift():
    """Four compactions, each head dropping a different whole block: every key and value row that was stored as
    codes reads back bit for bit after each of them (re-encoding the moved blocks would drift a little each time)."""
    layer = filled()
    length = ROWS
    for step in range(4):
        m = length - BS
        keep = torch.stack([torch.cat([torch.arange(BS), torch.arange(2 * BS, length)]),
                            torch.cat([torch.arange(3 * BS), torch.arange(4 * BS, length)])], 1)  # [m, heads]
        index = torch.arange(m)
        coded = ~staged(layer, keep)
        before = layer.read_head_rows(slots(keep), BS)
        window(layer, m)
        moved = (keep != index[:, None]).any(1)
        layer.move_heads(slots(keep[moved]), slots(index[moved]), BS)
        after = layer.read_rows(slots(index), BS)
        assert int(coded.sum()) >= 2 * (m - 3 * BS)
        for b, a in zip(before, after):
            assert torch.equal(a[coded], b[coded])
        length = m


def _compact_heads(layer, placement: torch.Tensor) -> None:
    """Move each head's rows as `placement` [heads, m] says (row placement[h, j] to index j), as compact does."""
    m = placement.shape[-1]
    index = torch.arange(m)
    window(layer, m)
    moved = rows_to_write((placement != index).any(0), BS)  # as compact(whole_blocks=True)
    layer.move_heads(slots(placement[:, moved].T), slots(index[moved]), BS)


def test_in_place_placement_keeps_the_codes_of_blocks_that_lost_no_row():
    """Scattered drops that differ per head (as Expected Attention makes), placed in place: every (block, head) that
    lost no row reads back bit for bit, keys included; packed in order, the blocks behind a head's first drop are
    regrouped and their keys encoded again from decoded rows, which moves them."""
    from kvforge.kv.policies.placement import in_place

    drops = [[20, 48, 50, 51], [40, 64, 70, 100]]  # 48 and 64 open a block at its first row
    kept = torch.stack([torch.tensor([i for i in range(ROWS) if i not in d]) for d in drops])  # [heads, m]
    m = kept.shape[-1]
    placement = in_place(kept, m // BS * BS)
    assert placement[0, :24].tolist() == list(range(20)) + [144, 21, 22, 23]
    assert placement[0, 144:].tolist() == [148, 149]
    assert torch.equal(placement.sort(-1).values, kept)
    untouched = torch.zeros(m, HEADS, dtype=torch.bool)  # coded blocks (below the window, 128) with no drop
    for h, d in enumerate(drops):
        for b in range(128 // BS):
            untouched[b * BS:(b + 1) * BS, h] = all(i // BS != b for i in d)
    results = {}
    for name, where in (("in_place", placement), ("packed", kept)):
        layer = filled()
        before = layer.read_head_rows(slots(where.T), BS)
        _compact_heads(layer, where)
        after = layer.read_rows(slots(torch.arange(m)), BS)
        coded = where.T < 128  # rows stored as codes (the window's were fp16: encoded once where they land)
        assert torch.equal(after[1][coded], before[1][coded])  # values move as their per-token codes
        results[name] = torch.equal(after[0][untouched & coded], before[0][untouched & coded])
    assert results == {"in_place": True, "packed": False}
