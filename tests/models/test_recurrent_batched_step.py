"""A step's recurrent sequences run as padded batches (models/state_batch.py) give what each sequence run alone gives:
one-row decodes beside short and long prefills, checkpoint cuts and per-row (speculative) cuts, the states left in
the slots and the copies captured, for the Mamba-2 mixer (B/C one group broadcast or per group) and lfm2's short
conv."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvforge.attention import AttentionMetadata
from kvforge.kv.groups import StateGroup
from kvforge.kv.state_pool import StatePool
from kvforge.models.lfm2 import ShortConv
from kvforge.models.mamba2_mixer import Mamba2Mixer, causal_conv, ssd_scan

HIDDEN, K = 32, 4
# decode, short prefill with a cut mid-way and at its end, decode with its one-row cut, speculative verify rows,
# a prefill longer than a padded batch takes, a two-token prompt start
LENS = [1, 13, 1, 5, 90, 2]
CUTS = [[], [8, 13], [1], [1, 2, 3, 4], [16, 32, 64, 80], []]
SLOTS = [4, 2, 6, 1, 0, 3]  # the short batch's slots one run (a view of the pool), the decodes' not


def _meta(lens, slots, cuts) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping=torch.zeros(0), positions=torch.zeros(0), query_lens=list(lens),
                             context_lens=list(lens), block_tables=[[] for _ in lens], block_size=16,
                             state_slots=list(slots), state_cuts=[list(c) for c in cuts] if any(cuts) else None)


def _pool(shapes) -> SimpleNamespace:
    pool = StatePool([StateGroup("mamba2", (0,), shapes)], num_slots=8, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    for t in pool.layer(0).values():  # states a sequence would carry in from earlier steps
        t.copy_(torch.randn(t.shape, generator=g))
    return SimpleNamespace(state=pool)


def _mixer(n_groups: int) -> Mamba2Mixer:
    torch.manual_seed(0)
    mixer = Mamba2Mixer(HIDDEN, {"n_heads": 4, "head_dim": 8, "d_state": 16, "n_groups": n_groups,
                                 "intermediate": 32, "time_step_limit": (0.0, float("inf")), "d_conv": K,
                                 "conv_bias": True, "proj_bias": False, "norm_eps": 1e-5}, layer_idx=0)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
        mixer.A_log.copy_(torch.rand(4).log())
    return mixer


def _mixer_alone(mixer: Mamba2Mixer, h, kv, i, start, n, slot, cuts):
    """The per-sequence path: the scan and conv (themselves checked against transformers and the recurrence)."""
    states = kv.state.layer(0)
    gate, xbc, dt = mixer.in_proj(h).split([mixer.intermediate, mixer.conv_dim, mixer.n_heads], dim=-1)
    dt = F.softplus(dt + mixer.dt_bias).clamp(*mixer.time_step_limit)
    conv, windows = causal_conv(xbc, states["conv"][slot], mixer.conv1d.weight, mixer.conv1d.bias, cuts)
    x, b, c = F.silu(conv).split([mixer.intermediate, mixer.n_groups * 16, mixer.n_groups * 16], -1)
    x = x.reshape(n, 4, 8)
    rep = 4 // mixer.n_groups
    b, c = (v.reshape(n, mixer.n_groups, 16).repeat_interleave(rep, dim=1) for v in (b, c))
    y, ssms = ssd_scan(x, dt, -torch.exp(mixer.A_log), b, c, states["ssm"][slot], cuts)
    for cut in cuts:
        kv.state.capture(i, cut, 0, {"conv": windows[cut], "ssm": ssms[cut]})
    return mixer.out_proj(mixer.norm((y + mixer.D[:, None] * x).reshape(n, -1), gate))


def _compare(run_batched, run_alone, shapes):
    g = torch.Generator().manual_seed(2)
    h = torch.randn(sum(LENS), HIDDEN, generator=g)
    batched, alone = _pool(shapes), _pool(shapes)
    meta = _meta(LENS, SLOTS, CUTS)
    with torch.inference_mode():
        got = run_batched(h, meta, batched)
        want = torch.cat([run_alone(h[s:s + n], alone, i, s, n, slot, cuts) for i, (s, n, slot, cuts)
                          in enumerate(zip(meta.query_start_loc, LENS, SLOTS, CUTS))])
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for name, t in batched.state.layer(0).items():
        torch.testing.assert_close(t, alone.state.layer(0)[name], atol=1e-5, rtol=1e-5, msg=name)
        assert torch.equal(t[[5, 7]], alone.state.layer(0)[name][[5, 7]])  # slots of no sequence untouched
    got_cuts, want_cuts = batched.state.take_captured(), alone.state.take_captured()
    assert got_cuts.keys() == want_cuts.keys() == {(i, c) for i, cs in enumerate(CUTS) for c in cs}
    for key, layers in want_cuts.items():
        for name, t in layers[0].items():
            torch.testing.assert_close(got_cuts[key][0][name], t, atol=1e-5, rtol=1e-5, msg=f"{key} {name}")


@pytest.mark.parametrize("n_groups", [1, 2])
def test_mamba2_mixer_batched_step_equals_each_sequence_alone(n_groups):
    mixer = _mixer(n_groups)
    conv_dim = mixer.conv_dim
    shapes = (("conv", (K - 1, conv_dim)), ("ssm", (4, 8, 16)))

    def alone(h, kv, i, start, n, slot, cuts):
        return _mixer_alone(mixer, h, kv, i, start, n, slot, cuts)
    _compare(lambda h, meta, kv: mixer(h, meta, kv), alone, shapes)


def test_short_conv_batched_step_equals_each_sequence_alone():
    torch.manual_seed(0)
    conv = ShortConv(HIDDEN, K, bias=True, layer_idx=0)

    def alone(h, kv, i, start, n, slot, cuts):
        b, c, x = conv.in_proj(h).chunk(3, dim=-1)
        out, saved = causal_conv(b * x, kv.state.layer(0)["conv"][slot], conv.conv.weight, conv.conv.bias, cuts)
        for cut in cuts:
            kv.state.capture(i, cut, 0, {"conv": saved[cut]})
        return conv.out_proj(c * out)
    _compare(lambda h, meta, kv: conv(h, meta, kv), alone, (("conv", (K - 1, HIDDEN)),))
