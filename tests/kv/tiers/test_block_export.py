"""Block export/import: every format (and MLA's latent rows) reads back bit for bit, staged and sink rows included."""
from __future__ import annotations

import pytest
import torch

from kvforge.errors import ConfigError
from kvforge.kv.formats import get_format
from kvforge.kv.pool import KVPool
from kvforge.kv.spec import KVCacheSpec

BS = 8
GQA = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, v_head_dim=16)
MLA = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=24, v_head_dim=0)
FORMATS = [("fp32", {}), ("fp16", {}), ("bf16", {}), ("int8", {}), ("fp8_e4m3", {}), ("fp8_e5m2", {}),
           ("int4", {"group_size": 8}), ("int4", {"group_size": 8, "key_axis": "token", "sinks": 0}),
           ("kivi2", {"group_size": 8, "window": 8}), ("kivi2", {"group_size": 8, "window": 0, "sinks": 2})]


def fill(pool: KVPool, spec: KVCacheSpec, blocks: list[int], gen: torch.Generator, rows: int = BS) -> None:
    """Write `rows` rows into each block, block by block as a sequence would (positions from 0)."""
    for i, b in enumerate(blocks):
        slots = torch.arange(rows) + b * BS
        positions = torch.arange(rows) + i * BS
        for layer in range(spec.num_layers):
            k = torch.randn(rows, spec.num_kv_heads, spec.head_dim, generator=gen)
            v = torch.randn(rows, spec.num_kv_heads, spec.v_head_dim, generator=gen) if spec.has_values else None
            pool.layers[layer].write(slots, k, v, positions)


def read(pool: KVPool, blocks: list[int]) -> list[tuple]:
    ids = torch.tensor(blocks)
    return [layer.gather(ids) for layer in pool.layers]


def same(a, b) -> bool:
    return all(torch.equal(x, y) if x is not None else y is None for la, lb in zip(a, b) for x, y in zip(la, lb))


@pytest.mark.parametrize("spec", [GQA, MLA], ids=["gqa", "mla"])
@pytest.mark.parametrize("name,opts", FORMATS, ids=[f"{n}{o}" for n, o in FORMATS])
def test_export_import_is_bit_exact(name, opts, spec):
    fmt = get_format(name, **opts)
    try:
        fmt.validate(spec, BS)
    except ConfigError:
        pytest.skip("format cannot store this spec")
    gen = torch.Generator().manual_seed(0)
    src = KVPool(spec, fmt, 12, BS, torch.device("cpu"), max_num_seqs=1)
    fill(src, spec, [0, 1, 2, 3, 4], gen)  # staged formats: the last blocks still sit in fp16 staging
    fill(src, spec, [5], gen, rows=3)  # a partly filled block (what swap moves)
    blocks = [0, 1, 2, 3, 4, 5]
    before = read(src, blocks)
    payloads = src.export_blocks(blocks)
    assert same(read(src, blocks), before)  # exporting leaves the blocks as they were
    dst = KVPool(spec, fmt, 12, BS, torch.device("cpu"), max_num_seqs=1)
    fill(dst, spec, [6, 7, 8], gen)  # entries already taken in the destination
    targets = [9, 10, 11, 6, 7, 8]
    dst.import_blocks(targets, payloads)
    after = read(dst, targets)
    assert same(after, before)
    assert dst.export_blocks(targets) == payloads


def test_payload_of_another_shape_is_refused():
    fmt = get_format("int8")
    src = KVPool(GQA, fmt, 2, BS, torch.device("cpu"))
    other = KVPool(KVCacheSpec(3, 2, 16, 16), fmt, 2, BS, torch.device("cpu"))
    with pytest.raises(ValueError):
        other.import_blocks([0], src.export_blocks([0]))


def test_quantized_payloads_stay_compressed():
    sizes = {}
    for name in ("fp32", "fp16", "int8", "int4"):
        pool = KVPool(GQA, get_format(name, **({"group_size": 8, "window": 0} if name == "int4" else {})), 4, BS, torch.device("cpu"),
                      max_num_seqs=1)
        fill(pool, GQA, [0, 1, 2], torch.Generator().manual_seed(1))
        sizes[name] = len(pool.export_blocks([1])[0])  # block 1: flushed from staging by block 2 (no fp16 window), no sinks
    assert sizes["fp32"] - 2 == 2 * (sizes["fp16"] - 2)  # one flag byte per layer
    assert sizes["int8"] < 0.6 * sizes["fp16"] and sizes["int4"] < 0.45 * sizes["fp16"]
