from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvforge.kv.blocks import BlockAllocator

NUM_BLOCKS = 16


class AllocatorMachine(RuleBasedStateMachine):
    """Holders take and drop references; the allocator must agree with their count."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(NUM_BLOCKS)
        self.held: list[int] = []

    @rule(n=st.integers(0, 6))
    def allocate(self, n: int) -> None:
        if self.alloc.can_allocate(n):
            ids = self.alloc.allocate(n)
            assert len(set(ids)) == n and not set(ids) & set(self.held)
            self.held += ids
        else:
            with pytest.raises(MemoryError):
                self.alloc.allocate(n)

    @precondition(lambda self: self.held)
    @rule(picks=st.lists(st.integers(0, 100), min_size=1, max_size=4))
    def incref(self, picks: list[int]) -> None:
        ids = [self.held[i % len(self.held)] for i in picks]
        self.alloc.incref(ids)
        self.held += ids

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def decref(self, i: int) -> None:
        b = self.held.pop(i % len(self.held))
        free_before = self.alloc.num_free
        self.alloc.decref([b])
        assert self.alloc.num_free == free_before + (b not in self.held)

    @invariant()
    def consistent(self) -> None:
        self.alloc.check()
        refs = Counter(self.held)
        assert self.alloc.ref_counts == [refs[b] for b in range(NUM_BLOCKS)]
        assert self.alloc.num_used + self.alloc.num_free == NUM_BLOCKS
        assert self.alloc.num_used == len(refs)

    def teardown(self) -> None:
        self.alloc.decref(self.held)
        self.alloc.check()
        assert self.alloc.num_free == NUM_BLOCKS


AllocatorMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_allocator_against_model = AllocatorMachine.TestCase


def test_double_free_and_incref_of_free_block_are_caught():
    alloc = BlockAllocator(2)
    (b,) = alloc.allocate(1)
    alloc.decref([b])
    with pytest.raises(AssertionError):
        alloc.decref([b])
    with pytest.raises(AssertionError):
        alloc.incref([b])
