"""kvforge::argmax_rows (csrc/greedy.cpp) gives torch.argmax's index: the first of equal maxima, rows of any length,
all -inf rows, infinities; the sampler's greedy tokens come from it."""
import pytest
import torch

from kvforge.ops.build import has_cpu_kernel, load_compiled
from kvforge.ops.greedy import argmax_rows

compiled = pytest.mark.skipif(not load_compiled() or not has_cpu_kernel("kvforge::argmax_rows"),
                              reason="compiled CPU kernels unavailable")


@compiled
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 33, 1000, 262_144])
def test_argmax_rows_equals_torch(vocab):
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[1] = float("-inf")
    if vocab > 3:
        logits[2, [1, vocab - 1]] = 1e4  # two equal maxima: the first wins
        logits[3, vocab // 2] = float("inf")
        logits[4, -1] = 1e4  # in the scalar tail
    got = torch.ops.kvforge.argmax_rows(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(-1))


@compiled
def test_argmax_rows_of_a_non_contiguous_view_and_the_wrapper():
    logits = torch.randn(4, 300)[:, ::2]
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))
    assert torch.equal(argmax_rows(logits.double()), logits.double().argmax(-1))  # the torch path
    with pytest.raises(RuntimeError, match="logits \\[N, V\\] fp32"):
        torch.ops.kvforge.argmax_rows(torch.randn(3))
