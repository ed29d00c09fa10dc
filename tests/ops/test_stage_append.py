"""kvforge::stage_append: the compiled CPU kernel against its torch reference, rows that qualify and rows that don't."""
import pytest
import torch

from kvforge.kv.quant.staging_op import stage_append, stage_append_reference
from kvforge.ops.build import load_compiled

BLOCKS, ENTRIES, BS, HEADS, DIM = 12, 5, 4, 2, 8


@pytest.fixture(scope="module")
def compiled():
    if not load_compiled():
        pytest.skip("no compiled kvforge ops on this machine (no compiler, or the build failed)")


def state(gen):
    entry_of = torch.full((BLOCKS,), -1, dtype=torch.int32)
    entry_of[torch.randperm(BLOCKS, generator=gen)[:ENTRIES]] = torch.arange(ENTRIES, dtype=torch.int32)
    stage = [torch.randn(ENTRIES, BS, HEADS, DIM, generator=gen).half() for _ in range(2)]
    return entry_of, stage, torch.zeros(ENTRIES, dtype=torch.bool)


CASES = {  # (block, offset) per row, positions (None: not given), sinks
    "staged rows, one fills its block": ([(0, 1), (1, BS - 1)], [5, 9], 4),
    "a row at offset 0": ([(0, 1), (1, 0)], None, 0),
    "a block without an entry": ([(0, 2), ("none", 1)], None, 0),
    "a position below the sinks": ([(0, 1)], [2], 4),
    "sinks off": ([(0, 1)], [2], 0),
    "too many rows": ([(0, 1)] * 9, None, 0),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("with_v", [True, False])
def test_compiled_matches_reference(compiled, case, with_v):
    gen = torch.Generator().manual_seed(len(case))
    rows, positions, sinks = CASES[case]
    entry_of, stage, full = state(gen)
    staged = entry_of.ge(0).nonzero().flatten().tolist()
    unstaged = entry_of.lt(0).nonzero().flatten().tolist()
    slots = torch.tensor([(unstaged[0] if b == "none" else staged[b]) * BS + o for b, o in rows])
    k, v = (torch.randn(len(rows), HEADS, DIM, generator=gen) for _ in range(2))
    pos = None if positions is None else torch.tensor(positions)
    results = []
    for op in (stage_append, stage_append_reference):
        mine = [s.clone() for s in stage], full.clone()
        took = op(slots, k, v if with_v else None, entry_of, mine[0][0], mine[0][1] if with_v else None, mine[1], BS,
                  8, pos, sinks)
        results.append((took, mine))
    (took, (rows_c, full_c)), (want, (rows_r, full_r)) = results
    assert took == want
    assert took == (case in ("staged rows, one fills its block", "sinks off"))
    for got, ref in zip(rows_c, rows_r):
        assert torch.equal(got, ref)
    assert torch.equal(full_c, full_r)
    if took:
        e = entry_of[slots // BS].long()
        assert torch.equal(rows_c[0][e, slots % BS], k.half())
        assert torch.equal(full_c, torch.zeros_like(full_c).index_fill_(0, e[slots % BS == BS - 1], True))
    else:
        assert all(torch.equal(got, before) for got, before in zip(rows_c, stage))
