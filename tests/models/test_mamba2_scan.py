"""The Mamba-2 mixer's SSD scan equals the token-by-token recurrence, states at checkpoint cuts included (cuts inside
a segment, at its end and across segments), with B/C per head or one group broadcast over the heads."""
import pytest
import torch

from kvforge.models.mamba2_mixer import SEGMENT, ssd_scan

T, H, P, N = SEGMENT + 30, 6, 8, 16


def _recurrence(x, dt, a, b, c, state, cuts):
    ys, saved = [], {}
    for t in range(x.shape[0]):
        state = state * torch.exp(dt[t] * a)[:, None, None] + (x[t] * dt[t][:, None])[..., None] * b[t][:, None, :]
        ys.append(torch.einsum("hn,hpn->hp", c[t], state))
        if t + 1 in cuts:
            saved[t + 1] = state.clone()
    return torch.stack(ys), saved, state


@pytest.mark.parametrize("shared", [True, False])
def test_scan_and_its_checkpoints_equal_the_recurrence(shared):
    g = torch.Generator().manual_seed(0)
    x, dt = torch.randn(T, H, P, generator=g), torch.rand(T, H, generator=g) * 0.3
    a, state = -torch.rand(H, generator=g), torch.randn(H, P, N, generator=g)
    b, c = (torch.randn(T, 1 if shared else H, N, generator=g) for _ in range(2))
    if shared:
        b, c = b.expand(T, H, N), c.expand(T, H, N)
    cuts = [5, 16, SEGMENT, SEGMENT + 16, T]
    want_y, want_saved, want_state = _recurrence(x, dt, a, b, c, state.clone(), cuts)
    ours = state.clone()
    y, saved = ssd_scan(x, dt, a, b, c, ours, cuts)
    assert want_y.abs().max() > 1.0
    torch.testing.assert_close(y, want_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours, want_state, atol=1e-5, rtol=1e-5)
    assert saved.keys() == set(cuts)
    for cut in cuts:
        torch.testing.assert_close(saved[cut], want_saved[cut], atol=1e-5, rtol=1e-5, msg=f"cut {cut}")
    assert saved[T] is not ours  # a copy: later tokens do not change it
