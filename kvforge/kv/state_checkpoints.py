"""StateCheckpoints: recurrent states at block boundaries, so a prefix-cache hit can resume a recurrent model.

KV blocks alone cannot resume a Mamba-2 or short-conv layer: it needs its state after exactly the matched tokens.
During prefill and decode the layers copy their state at chosen block boundaries (every `interval`-th one, and the
prompt's last whole block, so the same prompt or one extending it hits); each copy is kept here under the prefix it follows
(salt + tokens, the path of the prefix tree's node at that depth, confirmed on the tokens), with a byte budget of
its own and LRU order apart from the KV blocks (SGLang's MambaRadixCache shape: a node whose checkpoint went keeps
its KV, a "tombstone"). A request resumes from the deepest node that has both its blocks and a checkpoint.
With KV tiers, what the LRU evicts goes to `on_evict` (the tiers' write-back), and checkpoints loaded back from a
tier are kept here again (`put(..., from_tier=True)`).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

Checkpoint = dict[int, dict[str, torch.Tensor]]  # model layer -> state name -> tensor (one sequence's)
Key = tuple[str | None, tuple[int, ...]]


def checkpoint_key(salt: str | None, tokens: Sequence[int]) -> Key:
    return salt, tuple(tokens)


class StateCheckpoints:
    def __init__(self, budget_bytes: int, checkpoint_bytes: int, interval: int = 1):
        if interval < 1:
            raise ValueError(f"the checkpoint interval must be >= 1 block, got {interval}")
        self.budget_bytes, self.checkpoint_bytes, self.interval = budget_bytes, checkpoint_bytes, interval
        self._entries: OrderedDict[Key, Checkpoint] = OrderedDict()
        self.stored = self.hits = self.evicted = 0
        self.from_tiers = 0  # checkpoints loaded back from KV tiers
        self.on_evict: Callable[[Key, Checkpoint], None] | None = None  # sees each checkpoint the LRU evicts
        self.hits_stopped_short = 0  # prefix hits cut back to a shallower node for want of a checkpoint
        self.tokens_lost_short = 0  # cached KV tokens those hits could not use

    @property
    def capacity(self) -> int:
        return self.budget_bytes // self.checkpoint_bytes if self.checkpoint_bytes else 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def boundaries(self, prompt_len: int, start: int, end: int, block_size: int) -> list[int]:
        """Token counts in (start, end] after which a sequence with a prompt of prompt_len tokens should leave a
        checkpoint: every interval-th block boundary (in its prompt or its output, so the next turn of a chat
        resumes after the last one), and its prompt's last whole block (leaving one prompt token after it)."""
        if not self.capacity:
            return []
        last = (prompt_len - 1) // block_size * block_size
        step = self.interval * block_size
        out = list(range((start // step + 1) * step, end + 1, step))
        if start < last <= end and last not in out:
            out.append(last)
        return out

    def items(self) -> list[tuple[Key, Checkpoint]]:
        """Every checkpoint held, most recently used first."""
        return list(reversed(self._entries.items()))

    def get(self, key: Key) -> Checkpoint | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: Key, checkpoint: Checkpoint, from_tier: bool = False) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        if not self.capacity:
            return
        self._evict(len(self._entries) + 1 - self.capacity)
        self._entries[key] = checkpoint
        if from_tier:
            self.from_tiers += 1
        else:
            self.stored += 1

    def _evict(self, count: int) -> int:
        """The `count` least recently used checkpoints leave (to `on_evict`)."""
        n = max(0, min(count, len(self._entries)))
        for _ in range(n):
            key, checkpoint = self._entries.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(key, checkpoint)
        self.evicted += n
        return n

    def discard(self, key: Key) -> bool:
        """Evict one checkpoint (an operator's reset of one prefix; tests)."""
        if self._entries.pop(key, None) is None:
            return False
        self.evicted += 1
        return True

    def drop_lru(self, count: int = 1) -> int:
        """Evict the `count` least recently used checkpoints (a reset of the prefix cache, tests)."""
        return self._evict(count)

    def stats(self) -> dict:
        return {
            "state_checkpoints": len(self._entries),
            "state_checkpoints_stored": self.stored,
            "state_checkpoints_hit": self.hits,
            "state_checkpoints_evicted": self.evicted,
            "state_checkpoints_from_tiers": self.from_tiers,
            "state_checkpoint_bytes": self.checkpoint_bytes,
            "state_checkpoint_bytes_used": len(self._entries) * self.checkpoint_bytes,
            "state_checkpoint_budget_bytes": self.budget_bytes,
            "prefix_hits_short_of_checkpoint": self.hits_stopped_short,
            "prefix_tokens_short_of_checkpoint": self.tokens_lost_short,
        }
