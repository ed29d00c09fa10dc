"""Quantized formats: error bounds, slot orders, staging, sinks, outliers, copy-on-write."""
from __future__ import annotations

import pytest
import torch

from kvforge.kv.formats import get_format
from kvforge.kv.quant.packing import pack, unpack
from kvforge.kv.quant.scaled import ScaledCodec
from kvforge.kv.quant.uniform import UniformCodec
from kvforge.kv.spec import KVCacheSpec

SPEC = KVCacheSpec(num_layers=1, num_kv_heads=3, head_dim=64, v_head_dim=64)
BS = 16
# relative RMS error allowed on Gaussian rows
REL = {"int8": 0.01, "fp8_e4m3": 0.04, "fp8_e5m2": 0.08, "int4": 0.1, "kivi2": 0.4}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def outlier_heavy(n: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, 3, 64, generator=gen)
    x[:, :, 5] *= 20  # outlier channels, as keys have
    x[:, 1, 40] += 15
    spikes = torch.randint(0, x.numel(), (max(1, x.numel() // 500),), generator=gen)
    x.view(-1)[spikes] *= 50
    return x


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_unpack_round_trip(bits):
    q = torch.randint(0, 1 << bits, (5, 3, 64))
    packed = pack(q, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 3, 64 * bits // 8)
    assert torch.equal(unpack(packed, bits), q.float())


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_table_decode_equals_torch_conversion(dtype):
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    codes = codes[~codes.float().isnan()].view(1, -1, 1, 1)
    scale = torch.ones(1, codes.shape[1], 1, dtype=torch.float16)
    assert torch.equal(ScaledCodec(dtype).decode([codes, scale]), codes.float())


def test_scaled_codec_error_is_within_half_a_step():
    x = torch.randn(4, BS, 3, 64) * torch.rand(4, BS, 3, 1) * 10
    y = ScaledCodec(torch.int8).decode(ScaledCodec(torch.int8).encode(x))
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((y - x).abs() <= step * 0.5 * 1.002 + 1e-6).all()


@pytest.mark.parametrize("dtype,rel_step", [(torch.float8_e4m3fn, 2**-4), (torch.float8_e5m2, 2**-3)])
def test_fp8_codec_relative_error(dtype, rel_step):
    x = torch.randn(4, BS, 3, 64)
    y = ScaledCodec(dtype).decode(ScaledCodec(dtype).encode(x))
    amax = x.abs().amax(-1, keepdim=True)
    assert ((y - x).abs() <= x.abs() * rel_step * 1.01 + amax * 2e-3).all()


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("axis", ["token", "channel"])
def test_uniform_codec_error_within_half_a_step_of_group_range(bits, axis):
    x = torch.randn(3, BS, 3, 64) * 3 + 1
    c = UniformCodec(bits, axis, group_size=16)
    y = c.decode(c.encode(x))
    g, red = c._groups(x)
    span = g.amax(red, keepdim=True) - g.amin(red, keepdim=True)
    bound = (span / ((1 << bits) - 1) * 0.5 * 1.01 + span * 2e-3).expand_as(g).reshape(x.shape)
    assert ((y - x).abs() <= bound).all()


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_8bit_log_scales_cover_the_range_and_cost_less(axis):
    x = torch.randn(3, BS, 3, 64) * torch.rand(1, 1, 3, 64) * 5 + torch.randn(1, 1, 3, 64) * 3
    c = UniformCodec(4, axis, group_size=32, param_bits=8)
    parts = c.encode(x)
    scale = c._scale_zero(parts[1: 1 + c.num_params])[0]
    g, red = c._groups(x)
    span = g.amax(red, keepdim=True) - g.amin(red, keepdim=True)
    scale = scale.unsqueeze(red)
    lo = g.amin(red, keepdim=True)
    zero_step = (lo.amax(-1, keepdim=True) - lo.amin(-1, keepdim=True)) / 255 if c.coded_zero else 0.0
    assert (scale * 15 >= span - 1e-2).all() and (scale * 15 <= (span + zero_step) * 1.082 + 1e-2).all()
    err = (c.decode(parts) - x).abs()
    assert (c._groups(err)[0] <= scale * 0.5 * 1.01 + g.abs().amax(red, keepdim=True) * 1e-3).all()
    assert c.block_bytes(BS, 3, 64) < UniformCodec(4, axis, group_size=32).block_bytes(BS, 3, 64)


def test_8bit_channel_zeros_sit_at_most_one_grid_step_below_the_minimum():
    x = torch.randn(2, BS, 3, 64) + torch.randn(1, 1, 3, 64) * 8
    c = UniformCodec(4, "channel", param_bits=8)
    parts = c.encode(x)
    assert [p.dtype for p in parts] == [torch.uint8, torch.uint8, torch.uint8, torch.float16]
    zero = c._scale_zero(parts[1:4])[1]
    lo = x.amin(1)
    grid_step = (lo.amax(-1, keepdim=True) - lo.amin(-1, keepdim=True)) / 255
    assert (zero <= lo + lo.abs() * 1e-3).all() and (zero >= lo - grid_step * 1.01 - lo.abs() * 1e-3).all()
    assert c.block_bytes(BS, 3, 64) == BS * 3 * 32 + 3 * 64 * 2 + 3 * 2 * 2


def test_uniform_codec_keeps_outliers_exact():
    gen = torch.Generator().manual_seed(0)
    x = outlier_heavy(BS, gen).unsqueeze(0)
    c = UniformCodec(2, "channel", outlier_frac=0.01)
    y = c.decode(c.encode(x))
    top = x.abs().flatten().topk(5).indices
    assert torch.allclose(y.flatten()[top], x.flatten()[top], rtol=1e-3)
    plain = UniformCodec(2, "channel")
    assert rel(y, x) < rel(plain.decode(plain.encode(x)), x)


CASES = [("int8", {}), ("fp8_e4m3", {}), ("fp8_e5m2", {}), ("int4", {}), ("int4", {"key_axis": "token"}),
         ("int4", {"key_axis": "channel", "sinks": 4}), ("kivi2", {}), ("kivi2", {"window": 0, "sinks": 0})]


@pytest.mark.parametrize("heavy", [False, True], ids=["gauss", "outliers"])
@pytest.mark.parametrize("name,opts", CASES, ids=[f"{n}{o}" for n, o in CASES])
def test_any_slot_order_round_trips_within_bound(name, opts, heavy):
    gen = torch.Generator().manual_seed(1)
    n_seqs, blocks_per_seq = 3, 3
    layer = get_format(name, **opts).allocate(SPEC, 12, BS, torch.device("cpu"), max_num_seqs=n_seqs)
    tables = torch.randperm(12, generator=gen)[: n_seqs * blocks_per_seq].view(n_seqs, blocks_per_seq)
    n = BS * blocks_per_seq
    make = (lambda: outlier_heavy(n, gen)) if heavy else (lambda: torch.randn(n, 3, 64, generator=gen))
    ks, vs = [make() for _ in range(n_seqs)], [make() for _ in range(n_seqs)]
    slots = [(t[:, None] * BS + torch.arange(BS)).flatten() for t in tables]
    pos = torch.arange(n)
    for s in range(0, n, 7):  # chunks of 7 tokens, the sequences interleaved and shuffled within a step
        idx = torch.cat([torch.stack([torch.full((len(pos[s:s + 7]),), i), pos[s:s + 7]], 1) for i in range(n_seqs)])
        idx = idx[torch.randperm(len(idx), generator=gen)]
        seq, p = idx[:, 0], idx[:, 1]
        sl = torch.stack(slots)[seq, p]
        layer.write(sl, torch.stack(ks)[seq, p], torch.stack(vs)[seq, p], positions=p)
    for i in range(n_seqs):
        gk, gv = layer.gather(tables[i])
        limit = REL[name] * (2.5 if heavy else 1)
        assert rel(gk, ks[i]) < limit and rel(gv, vs[i]) < limit, (rel(gk, ks[i]), rel(gv, vs[i]))


def test_per_token_format_writes_rows_directly_and_identically():
    x = torch.randn(BS, 3, 64)
    a = get_format("int8").allocate(SPEC, 2, BS, torch.device("cpu"))
    b = get_format("int8").allocate(SPEC, 2, BS, torch.device("cpu"))
    a.write(torch.arange(BS), x, x)
    for i in torch.randperm(BS).tolist():
        b.write(torch.tensor([i]), x[i:i + 1], x[i:i + 1])
    assert all(torch.equal(s, t) for s, t in zip(a.gather(torch.tensor([0]))[0], b.gather(torch.tensor([0]))[0]))


def test_partial_block_stays_exact_until_flushed():
    layer = get_format("kivi2", window=0, sinks=0).allocate(SPEC, 4, BS, torch.device("cpu"), max_num_seqs=1)
    x = torch.randn(2 * BS, 3, 64)
    layer.write(torch.arange(10), x[:10], x[:10])
    gk, _ = layer.gather(torch.tensor([0]))
    assert torch.equal(gk[:10], x[:10].half().float())
    layer.write(torch.arange(10, 2 * BS), x[10:], x[10:])  # block 1 takes the only entry: block 0 is quantized
    gk, _ = layer.gather(torch.tensor([0, 1]))
    assert not torch.equal(gk[:BS], x[:BS].half().float()) and rel(gk[:BS], x[:BS]) < REL["kivi2"]
    assert torch.equal(gk[BS:], x[BS:].half().float())


def test_residual_window_keeps_recent_blocks_exact():
    layer = get_format("kivi2", window=32, sinks=0).allocate(SPEC, 8, BS, torch.device("cpu"), max_num_seqs=1)
    x = torch.randn(6 * BS, 3, 64)
    for t in range(0, 6 * BS, 5):
        layer.write(torch.arange(t, min(t + 5, 6 * BS)), x[t:t + 5], x[t:t + 5])
    gk, _ = layer.gather(torch.arange(6))
    assert torch.equal(gk[3 * BS:], x[3 * BS:].half().float())  # last 2 full blocks + 1 entry of room
    assert rel(gk[: 3 * BS], x[: 3 * BS]) > 1e-3


def test_sinks_are_exact_and_do_not_spoil_their_block():
    layer = get_format("kivi2", window=0, sinks=4).allocate(SPEC, 4, BS, torch.device("cpu"), max_num_seqs=1)
    x = torch.randn(2 * BS, 3, 64)
    x[:4] *= 100  # attention-sink tokens have huge keys
    layer.write(torch.tensor([2 * BS + i for i in range(BS)] + list(range(BS))), x, x, positions=torch.arange(2 * BS))
    layer.write(torch.tensor([BS]), x[:1], x[:1], positions=torch.tensor([2 * BS]))  # evicts the staged blocks
    gk, _ = layer.gather(torch.tensor([2]))
    assert torch.equal(gk[:4], x[:4].half().float())
    assert rel(gk[4:], x[4:BS]) < REL["kivi2"]


def test_reused_block_drops_old_sinks_and_stage():
    layer = get_format("kivi2", window=0, sinks=4).allocate(SPEC, 2, BS, torch.device("cpu"), max_num_seqs=1)
    layer.write(torch.arange(BS), torch.randn(BS, 3, 64) * 50, torch.randn(BS, 3, 64), positions=torch.arange(BS))
    y = torch.randn(BS, 3, 64)
    layer.write(torch.arange(BS), y, y, positions=torch.arange(100, 100 + BS))  # reallocated to another sequence
    gk, gv = layer.gather(torch.tensor([0]))
    assert torch.equal(gk, y.half().float()) and torch.equal(gv, y.half().float())


def test_mla_latent_without_values():
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=576, v_head_dim=0)
    for name in ("int8", "fp8_e4m3", "int4", "kivi2"):
        layer = get_format(name).allocate(spec, 3, BS, torch.device("cpu"))
        x = torch.randn(40, 1, 576)
        layer.write(torch.arange(40), x, None, positions=torch.arange(40))
        gk, gv = layer.gather(torch.arange(3))
        assert gv is None and rel(gk[:40], x) < REL[name]


@pytest.mark.parametrize("name,opts,spec", [
    ("int4", {}, SPEC), ("kivi2", {}, SPEC), ("kivi2", {"sinks": 0, "window": 0}, SPEC),
    ("int8", {"window": 16, "sinks": 2}, SPEC),
    ("int4", {}, KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=64, v_head_dim=0))])
def test_decode_rows_into_staged_blocks_store_what_the_general_write_stores(name, opts, spec):
    """Writes of one row per sequence take the staged fast path; every storage tensor ends as the general path's."""
    fmt = get_format(name, **opts)
    fast, slow = (fmt.allocate(spec, 24, BS, torch.device("cpu"), max_num_seqs=2) for _ in range(2))
    slow._append_staged = lambda *args: False
    taken = []
    append = fast._append_staged
    fast._append_staged = lambda *args: taken.append(append(*args)) or taken[-1]
    tables = [list(range(0, 24, 2)), list(range(1, 24, 2))]  # interleaved blocks of two sequences
    gen = torch.Generator().manual_seed(3)
    lens = [21, 7]

    def slot(s, pos):
        return tables[s][pos // BS] * BS + pos % BS

    def rows(n):
        k = torch.randn(n, spec.num_kv_heads, spec.head_dim, generator=gen)
        return k, torch.randn(n, spec.num_kv_heads, spec.v_head_dim, generator=gen) if spec.has_values else None

    for s, n in enumerate(lens):
        slots, (k, v) = torch.tensor([slot(s, p) for p in range(n)]), rows(n)
        for layer in (fast, slow):
            layer.write(slots, k, v, positions=torch.arange(n))
    for _ in range(60):
        slots, (k, v) = torch.tensor([slot(s, n) for s, n in enumerate(lens)]), rows(2)
        for layer in (fast, slow):
            layer.write(slots, k, v, positions=torch.tensor(lens))
        lens = [n + 1 for n in lens]
    assert sum(taken) > 40 and not all(taken)
    assert all(torch.equal(a, b) for a, b in zip(fast.tensors(), slow.tensors()))


@pytest.mark.parametrize("name,opts", [("int8", {}), ("fp8_e5m2", {}),
                                       ("int4", {"key_axis": "token", "window": 0, "sinks": 0})])
def test_direct_writes_store_each_sides_own_codes(name, opts):
    """K and V encoded together (one call) store exactly what each side's codec makes of it alone."""
    layer = get_format(name, **opts).allocate(SPEC, 4, BS, torch.device("cpu"))
    assert layer.direct and layer.same_codec
    slots = torch.tensor([3, 17, 40, 41, 63])
    k, v = torch.randn(5, 3, 64) * 3, torch.randn(5, 3, 64)
    layer.write(slots, k, v)
    for codec, parts, x in zip(layer.codecs, layer.parts, (k, v)):
        for part, want in zip(parts, codec.encode(x.unsqueeze(0))):
            assert torch.equal(part.view(-1, *part.shape[2:])[slots], want[0])
