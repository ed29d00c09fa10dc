from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvforge.kv.blocks import BlockAllocator
from kvforge.kv.prefix import PrefixTree, RadixNode


def make(num_blocks: int = 32, block_size: int = 4) -> tuple[BlockAllocator, PrefixTree]:
    alloc = BlockAllocator(num_blocks)
    return alloc, PrefixTree(alloc, block_size)


def test_only_whole_blocks_are_cached():
    alloc, tree = make()
    ids = alloc.allocate(3)
    assert tree.insert(list(range(10)), ids)[0] == 0
    assert tree.cached_blocks == 2 and alloc.ref_counts[ids[2]] == 1
    assert tree.match_prefix(list(range(10))).block_ids == ids[:2]
    m = tree.match_prefix(list(range(7)))
    assert (m.block_ids, m.num_tokens) == (ids[:1], 4)
    assert tree.match_prefix([0, 1, 2]).num_tokens == 0
    assert tree.insert([0, 1, 2], [])[0] == 0
    tree.check()


def test_split_when_match_ends_inside_an_edge():
    alloc, tree = make()
    a = list(range(12))
    ids = alloc.allocate(3)
    tree.insert(a, ids)
    m = tree.match_prefix(a[:8] + [99, 99, 99, 99])
    assert m.block_ids == ids[:2] and m.node.block_ids == ids[:2]
    tree.check()
    b = a[:4] + [7, 7, 7, 7]
    other = alloc.allocate(2)
    assert tree.insert(b, other)[0] == 4
    assert alloc.ref_counts[other[0]] == 1 and alloc.ref_counts[other[1]] == 2
    assert tree.match_prefix(a).block_ids == ids
    assert tree.match_prefix(b).block_ids == [ids[0], other[1]]
    assert tree.cached_blocks == 4
    tree.check()


def test_salts_never_share():
    alloc, tree = make()
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    ids = alloc.allocate(2)
    tree.insert(toks, ids, salt="alice")
    assert tree.match_prefix(toks).num_tokens == 0
    assert tree.match_prefix(toks, salt="bob").num_tokens == 0
    assert tree.match_prefix(toks, salt="alice").block_ids == ids
    mine = alloc.allocate(2)
    assert tree.insert(toks, mine)[0] == 0
    assert tree.match_prefix(toks).block_ids == mine
    tree.check()


def test_duplicate_insert_keeps_the_trees_blocks():
    alloc, tree = make()
    toks = list(range(8))
    first, second = alloc.allocate(2), alloc.allocate(3)
    assert tree.insert(toks, first)[0] == 0
    assert tree.insert(toks + [8, 9, 10, 11, 12], second)[0] == 8
    assert [alloc.ref_counts[b] for b in second] == [1, 1, 2]
    assert tree.match_prefix(toks + [8, 9, 10, 11]).block_ids == first + [second[2]]
    alloc.decref(first)
    alloc.decref(second)
    assert alloc.num_used == 3
    tree.check()


def test_locked_nodes_are_never_reclaimed():
    alloc, tree = make()
    ids = alloc.allocate(2)
    tree.insert(list(range(8)), ids)
    alloc.decref(ids)
    m = tree.match_prefix(list(range(4)))
    tree.lock(m.node)
    assert tree.reclaimable_blocks() == 1
    assert tree.reclaim(10) == 1
    assert tree.match_prefix(list(range(8))).block_ids == ids[:1]
    tree.unlock(m.node)
    assert tree.reclaim(10) == 1
    assert alloc.num_free == 32 and tree.cached_blocks == 0 and tree.reclaimed_blocks == 2
    with pytest.raises(ValueError, match="not locked"):
        tree.unlock(m.node)
    tree.check()


def test_lock_survives_a_split_of_the_locked_edge():
    alloc, tree = make()
    a, b = list(range(12)), list(range(4)) + [9] * 4
    ia = alloc.allocate(3)
    tree.insert(a, ia)
    m = tree.match_prefix(a)
    tree.lock(m.node)
    ib = alloc.allocate(2)
    assert tree.insert(b, ib)[0] == 4
    alloc.decref(ia + ib)
    tree.check()
    assert tree.reclaimable_blocks() == 1
    assert tree.reclaim(10) == 1 and tree.peek_prefix(a) == 12
    tree.unlock(m.node)
    tree.check()
    assert tree.reclaim(10) == 3 and alloc.num_free == 32


def test_lru_order_and_parents_become_leaves():
    alloc, tree = make()
    a, b = [1] * 4 + [2] * 4, [1] * 4 + [3] * 4
    ia = alloc.allocate(2)
    ib = [ia[0]] + alloc.allocate(1)
    tree.insert(a, ia)
    tree.insert(b, ib)
    alloc.decref(ia + ib[1:])
    tree.match_prefix(a)
    assert tree.reclaim(1) == 1
    assert tree.peek_prefix(a) == 8 and tree.peek_prefix(b) == 4
    assert tree.reclaim(2) == 2
    assert tree.cached_blocks == 0 and alloc.num_free == 32
    tree.check()


def test_partial_match_touches_only_the_matched_part():
    alloc, tree = make()
    a, b = [1] * 8, [2] * 4
    tree.insert(a, alloc.allocate(2))
    tree.insert(b, alloc.allocate(1))
    alloc.decref(list(range(3)))
    assert tree.match_prefix([1] * 4 + [5] * 4).num_tokens == 4
    assert tree.reclaim(1) == 1
    assert tree.peek_prefix(a) == 4 and tree.peek_prefix(b) == 4
    tree.check()


def test_blocks_still_held_elsewhere_stay_cached():
    alloc, tree = make()
    toks = list(range(12))
    ids = alloc.allocate(3)
    tree.insert(toks, ids)
    alloc.decref(ids[2:])
    assert tree.reclaimable_blocks() == 1
    assert tree.reclaim(3) == 1
    assert tree.match_prefix(toks).block_ids == ids[:2]
    assert tree.reclaim(3) == 0
    alloc.decref(ids[:2])
    assert tree.reclaim(3) == 2 and alloc.num_free == 32
    tree.check()


def test_reclaim_everything_and_bad_arguments():
    alloc, tree = make()
    ids = alloc.allocate(2)
    tree.insert(list(range(8)), ids)
    m = tree.match_prefix(list(range(8)))
    tree.lock(m.node)
    alloc.decref(ids)
    assert tree.reclaim(10**6) == 0  # locked
    tree.unlock(m.node)
    assert tree.reclaim(10**6) == 2
    assert alloc.num_free == 32 and tree.cached_blocks == 0
    tree.check()
    with pytest.raises(ValueError, match="block ids"):
        tree.insert(list(range(8)), [0])
    with pytest.raises(ValueError, match="block_size"):
        PrefixTree(alloc, 0)


@dataclass
class Seq:
    tokens: list[int]
    salt: str | None
    blocks: list[int]
    node: RadixNode
    protected: set[tuple[str | None, tuple[int, ...]]]


NUM_BLOCKS = 24
BASES = [[0] * 14, [0, 1] * 7, [1, 2, 0] * 5, [0, 0, 1, 1, 2, 2] * 3]
token_lists = st.builds(
    lambda base, cut, tail: base[:cut] + tail,
    st.sampled_from(BASES), st.integers(0, 14), st.lists(st.integers(0, 2), max_size=5),
)
salts = st.sampled_from([None, "t1"])


class PrefixTreeMachine(RuleBasedStateMachine):
    """The tree against a naive model: {(salt, whole-block prefix): block id of its last block}."""

    @initialize(block_size=st.sampled_from([2, 3, 4]))
    def setup(self, block_size: int) -> None:
        self.bs = block_size
        self.alloc = BlockAllocator(NUM_BLOCKS)
        self.tree = PrefixTree(self.alloc, block_size)
        self.model: dict[tuple[str | None, tuple[int, ...]], int] = {}
        self.seqs: list[Seq] = []
        self.handles: list[tuple[RadixNode, set]] = []

    def naive(self, tokens: list[int], salt: str | None) -> list[int]:
        out, bs = [], self.bs
        while (len(out) + 1) * bs <= len(tokens) and (salt, tuple(tokens[:(len(out) + 1) * bs])) in self.model:
            out.append(self.model[(salt, tuple(tokens[:(len(out) + 1) * bs]))])
        return out

    def keys(self, tokens: list[int], salt: str | None, n: int) -> set:
        return {(salt, tuple(tokens[:k * self.bs])) for k in range(1, n + 1)}

    def match(self, tokens: list[int], salt: str | None):
        expected = self.naive(tokens, salt)
        assert self.tree.peek_prefix(tokens, salt) == len(expected) * self.bs
        m = self.tree.match_prefix(tokens, salt)
        assert m.block_ids == expected and m.num_tokens == len(expected) * self.bs
        return m

    def insert(self, seq: Seq) -> None:
        cached = len(self.naive(seq.tokens, seq.salt))
        assert self.tree.insert(seq.tokens, seq.blocks, seq.salt)[0] == cached * self.bs
        for k in range(cached + 1, len(seq.tokens) // self.bs + 1):
            self.model[(seq.salt, tuple(seq.tokens[:k * self.bs]))] = seq.blocks[k - 1]

    def do_evict(self, n: int) -> int:
        before = self.tree.reclaimable_blocks()
        freed = self.tree.reclaim(n)
        assert freed >= min(n, before) and (freed >= n or self.tree.reclaimable_blocks() == 0)
        if n >= before:
            assert freed == before
        gone = [k for k in self.model if self.tree.peek_prefix(k[1], k[0]) < len(k[1])]
        assert len(gone) == freed
        protected = set().union(*(s.protected for s in self.seqs), *(p for _, p in self.handles))
        for key in gone:
            assert key not in protected, "evicted a locked block"
            assert self.alloc.ref_counts[self.model.pop(key)] == 0, "evicted block did not become free"
        return freed

    @rule(tokens=token_lists, salt=salts)
    def start_seq(self, tokens: list[int], salt: str | None) -> None:
        m = self.match(tokens, salt)
        self.tree.lock(m.node)
        self.alloc.incref(m.block_ids)
        need = -(-len(tokens) // self.bs) - len(m.block_ids)
        if not self.alloc.can_allocate(need):
            self.do_evict(need - self.alloc.num_free)
        if not self.alloc.can_allocate(need):
            self.tree.unlock(m.node)
            self.alloc.decref(m.block_ids)
            return
        blocks = m.block_ids + self.alloc.allocate(need)
        self.seqs.append(Seq(tokens, salt, blocks, m.node, self.keys(tokens, salt, len(m.block_ids))))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), cache=st.booleans())
    def finish_seq(self, i: int, cache: bool) -> None:
        seq = self.seqs.pop(i % len(self.seqs))
        if cache:
            self.insert(seq)
        self.tree.unlock(seq.node)
        self.alloc.decref(seq.blocks)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def cache_running_seq(self, i: int) -> None:
        self.insert(self.seqs[i % len(self.seqs)])

    @rule(tokens=token_lists, salt=salts)
    def match_only(self, tokens: list[int], salt: str | None) -> None:
        self.match(tokens, salt)

    @rule(tokens=token_lists, salt=salts)
    def lock(self, tokens: list[int], salt: str | None) -> None:
        m = self.match(tokens, salt)
        self.tree.lock(m.node)
        self.handles.append((m.node, self.keys(tokens, salt, len(m.block_ids))))

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        self.tree.unlock(self.handles.pop(i % len(self.handles))[0])

    @rule(n=st.sampled_from([0, 1, 2, 3, 5, 8, 1000]))
    def evict(self, n: int) -> None:
        self.do_evict(n)

    @invariant()
    def accounted(self) -> None:
        self.tree.check()
        self.alloc.check()
        refs = Counter(self.model.values())
        for s in self.seqs:
            refs.update(s.blocks)
        assert self.alloc.ref_counts == [refs[b] for b in range(NUM_BLOCKS)]
        assert self.alloc.num_used == len(set(self.model.values()).union(*(s.blocks for s in self.seqs)))
        assert self.tree.cached_blocks == len(self.model)
        for salt, toks in self.model:
            assert self.tree.peek_prefix(toks, salt) == len(toks)
        assert 0 <= self.tree.reclaimable_blocks() <= self.tree.cached_blocks

    def teardown(self) -> None:
        for seq in self.seqs:
            self.tree.unlock(seq.node)
            self.alloc.decref(seq.blocks)
        for node, _ in self.handles:
            self.tree.unlock(node)
        self.seqs, self.handles = [], []
        cached = len(self.model)
        assert self.tree.reclaimable_blocks() == cached
        assert self.do_evict(10**6) == cached and not self.model
        assert self.tree.cached_blocks == 0 and self.alloc.num_free == NUM_BLOCKS
        self.tree.check()
        self.alloc.check()


PrefixTreeMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
test_prefix_tree_against_model = PrefixTreeMachine.TestCase
