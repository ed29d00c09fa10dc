"""KV cache groups: layers with the same attention kind and cached shape share block tables.

Each group has its own block table per sequence. Groups are equally sized (as in vLLM's hybrid allocator),
so one block id stands for the same bytes in every group: the pool stores `group_size` layer slots, and
slot i of a block belongs to layer `layers[i]` of the group that allocated the block. A model whose layers
are all alike is one group of every layer. A sliding-window group frees a sequence's blocks that lie
wholly behind the window (its table keeps a placeholder there), so it holds about window + one block
rows per layer instead of the whole history.

Recurrent layers (Mamba-2 mixers, short convolutions) cache no rows: each keeps a fixed state per sequence
(`StateGroup`), held in the state pool beside the blocks (kv/state_pool.py), in the same budget. A hybrid's
KV groups hold its attention layers only, numbered in attention order (the model maps its layers onto them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

NULL_BLOCK = -1  # a sliding group's placeholder for a block freed behind the window


@dataclass(frozen=True)
class KVGroup:
    layers: tuple[int, ...]  # model layers in slot order
    window: int | None  # sliding window in tokens; None = full attention (the group keeps every token)

    @property
    def sliding(self) -> bool:
        return self.window is not None

    def first_needed_block(self, num_computed: int, block_size: int) -> int:
        """Blocks before this one hold no key a query at position >= num_computed can see."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // block_size

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks one sequence holds while decoding its num_tokens-th token (the one formula's per-group count)."""
        total = math.ceil(num_tokens / block_size)
        return total - self.first_needed_block(num_tokens - 1, block_size)


@dataclass(frozen=True)
class StateGroup:
    """Layers of one recurrent kind whose per-sequence state has the same shapes (fp32)."""
    kind: str  # "mamba2" | "short_conv"
    layers: tuple[int, ...]  # model layers (not KV layer indices)
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # each state tensor of one layer: name, shape

    def bytes_per_layer(self) -> int:
        return 4 * sum(math.prod(shape) for _, shape in self.shapes)

    def bytes_per_sequence(self) -> int:
        return len(self.layers) * self.bytes_per_layer()


def state_bytes_per_sequence(state_groups: list[StateGroup] | tuple[StateGroup, ...]) -> int:
    """Bytes of recurrent state one running sequence holds, whatever its length."""
    return sum(g.bytes_per_sequence() for g in state_groups)


def build_groups(layer_windows: list[int | None], hybrid: bool = True) -> list[KVGroup]:
    """Groups for the layers' windows. hybrid=False keeps every layer's full history in one group (the old
    behaviour, for comparisons); attention still applies each layer's window."""
    if not layer_windows:  # no attention layer (a pure recurrent model): one empty group, blocks of no bytes
        return [KVGroup((), None)]
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window if hybrid else None, []).append(layer)
    if len(kinds) == 1:
        window, layers = next(iter(kinds.items()))
        return [KVGroup(tuple(layers), window)]
    size = min(len(layers) for layers in kinds.values())
    return [KVGroup(tuple(layers[i:i + size]), window)
            for window, layers in sorted(kinds.items(), key=lambda kv: kv[0] is not None)
            for i in range(0, len(layers), size)]


def group_size(groups: list[KVGroup]) -> int:
    """Layer slots one block spans: the largest group (smaller ones leave slots unused)."""
    return max(len(g.layers) for g in groups)


def sequence_blocks(groups: list[KVGroup], num_tokens: int, block_size: int) -> int:
    """Blocks one sequence of num_tokens holds over all groups while it decodes."""
    return sum(g.blocks_held(num_tokens, block_size) for g in groups)
