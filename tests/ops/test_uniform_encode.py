"""kvforge::uniform_encode: the compiled CPU kernel against its torch reference, part for part, for both axes, every
code width, both parameter widths, with and without outliers, and for rows the reference treats specially."""
import pytest
import torch

from kvforge.kv.quant.uniform import UniformCodec, encode_reference, head_major, uniform_encode
from kvforge.ops.build import has_cpu_kernel, load_compiled


@pytest.fixture(scope="module")
def compiled():
    if not load_compiled():
        pytest.skip("no compiled kvforge ops on this machine (no compiler, or the build failed)")
    assert has_cpu_kernel("kvforge::uniform_encode")


def rows(kind: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=gen) * torch.rand(shape[-1], generator=gen) * 4 + torch.randn(shape[-1], generator=gen)
    if kind == "constant rows":  # every group's range is 0: the smallest scale
        x[:, :, 0] = 1.5
    if kind == "outlier-heavy":  # a few groups dominated by far values
        x[:, 0, :, :8] *= 50
    return x


@pytest.mark.parametrize("kind", ["random", "constant rows", "outlier-heavy"])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("axis,group", [("channel", 32), ("token", 16), ("token", 64)])
@pytest.mark.parametrize("param_bits", [8, 16])
@pytest.mark.parametrize("outlier_frac", [0.0, 0.01, 0.2])
def test_compiled_matches_reference(compiled, kind, bits, axis, group, param_bits, outlier_frac):
    gen = torch.Generator().manual_seed(bits * 100 + group + param_bits)
    x = rows(kind, (3, 16, 2, 64), gen)
    codec = UniformCodec(bits, axis, group, outlier_frac, param_bits)
    n_out = codec.num_outliers(*x.shape[1:])
    table = codec._scale_table(x.device) if param_bits == 8 else None
    got = uniform_encode(x, bits, axis == "channel", group, n_out, param_bits, table)
    want = encode_reference(x, bits, axis == "channel", group, n_out, param_bits, table)
    assert [(p.shape, p.dtype) for p in got] == [(p.shape, p.dtype) for p in want]
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    if n_out:  # stored by head, then row, then channel
        assert bool((head_major(got[-2].long(), *x.shape[1:]).diff(dim=1) > 0).all())
    assert torch.equal(codec.decode(got), codec.decode(want))


def test_wide_blocks_use_int32_indices(compiled):
    x = torch.randn(1, 64, 8, 128, generator=torch.Generator().manual_seed(1))  # 65,536 values per block
    x[0, 60, 7, 5] = 100.0  # an outlier past index 2**15
    got = uniform_encode(x, 2, True, 32, 30, 16, None)
    want = encode_reference(x, 2, True, 32, 30, 16, None)
    assert got[-2].dtype == want[-2].dtype == torch.int32
    assert (60 * 8 + 7) * 128 + 5 in got[-2][0].tolist()
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_bad_shapes_are_refused(compiled):
    with pytest.raises(RuntimeError, match="group_size must divide dim"):
        uniform_encode(torch.randn(1, 4, 2, 48), 4, False, 32, 0, 16, None)
    with pytest.raises(RuntimeError, match="256-entry table"):
        uniform_encode(torch.randn(1, 4, 2, 64), 4, True, 32, 0, 8, None)
