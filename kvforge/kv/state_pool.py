"""StatePool: a fixed number of recurrent-state slots beside the block pool, one per running sequence.

Each recurrent layer keeps its state tensors (a Mamba-2 mixer: conv window + SSM state; a short conv: its window)
as one tensor per name of shape [num_slots, *shape]. A sequence takes a slot at admission (zeroed: the state
before any token) and gives it back when it finishes, is aborted or is preempted. The bytes are the formula's
(kv/memory.py, `state_bytes` per sequence); `allocated_bytes` lets a test check them.
"""
from __future__ import annotations

from collections import deque

import torch

from kvforge.kv.groups import StateGroup


class StatePool:
    def __init__(self, groups: list[StateGroup], num_slots: int, device: torch.device):
        self.groups, self.num_slots = list(groups), num_slots
        self.layers: dict[int, dict[str, torch.Tensor]] = {}
        for group in self.groups:
            for layer in group.layers:
                self.layers[layer] = {name: torch.zeros(num_slots, *shape, dtype=torch.float32, device=device)
                                      for name, shape in group.shapes}
        self._free: deque[int] = deque(range(num_slots))
        # this step's checkpoint copies: (sequence index in the step, tokens into its chunk) -> layer -> name -> tensor
        self.captured: dict[tuple[int, int], dict[int, dict[str, torch.Tensor]]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int | None:
        """A zeroed slot, or None when every slot is taken."""
        if not self._free:
            return None
        slot = self._free.popleft()
        self.zero(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"state slot {slot} is not in use (pool of {self.num_slots})")
        self._free.append(slot)

    def zero(self, slot: int) -> None:
        for tensors in self.layers.values():
            for t in tensors.values():
                t[slot].zero_()

    def capture(self, seq_index: int, cut: int, layer: int, tensors: dict[str, torch.Tensor]) -> None:
        """A recurrent layer's state copy after `cut` tokens of the step's sequence `seq_index` (a checkpoint)."""
        self.captured.setdefault((seq_index, cut), {})[layer] = tensors

    def take_captured(self) -> dict[tuple[int, int], dict[int, dict[str, torch.Tensor]]]:
        """The copies made since the last call (only whole ones: every recurrent layer's)."""
        captured, self.captured = self.captured, {}
        return {k: v for k, v in captured.items() if len(v) == len(self.layers)}

    def restore_layers(self, slot: int, checkpoint: dict[int, dict[str, torch.Tensor]]) -> None:
        """Make `slot` hold a checkpoint made of captures."""
        for layer, tensors in checkpoint.items():
            for name, t in tensors.items():
                self.layers[layer][name][slot].copy_(t)

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        """Model layer `layer`'s state tensors by name, each [num_slots, *shape]."""
        return self.layers[layer]

    def snapshot(self, slot: int) -> list[torch.Tensor]:
        """A copy of every layer's state in `slot` (a checkpoint), in a fixed order."""
        return [t[slot].clone() for tensors in self.layers.values() for t in tensors.values()]

    def restore(self, slot: int, saved: list[torch.Tensor]) -> None:
        """Make `slot` hold what `snapshot` returned."""
        tensors = [t for ts in self.layers.values() for t in ts.values()]
        if len(tensors) != len(saved):
            raise ValueError(f"a state checkpoint of {len(saved)} tensors does not fit this pool's {len(tensors)}")
        for t, s in zip(tensors, saved):
            t[slot].copy_(s)

    def export_slot(self, slot: int) -> bytes:
        """Every layer's state in `slot` as one payload (float32, the `snapshot` order): what a swap moves."""
        return torch.cat([t.reshape(-1) for t in self.snapshot(slot)]).cpu().numpy().tobytes()

    def import_slot(self, slot: int, payload: bytes) -> None:
        """Make `slot` hold what `export_slot` returned; ValueError when the payload is not one of this pool's."""
        if len(payload) != self.slot_bytes():
            raise ValueError(f"a recurrent state payload of {len(payload)} bytes does not fit this pool's slots "
                             f"of {self.slot_bytes()}")
        flat, pos = torch.frombuffer(bytearray(payload), dtype=torch.float32), 0
        for tensors in self.layers.values():
            for t in tensors.values():
                n = t[slot].numel()
                t[slot].copy_(flat[pos:pos + n].view(t[slot].shape))
                pos += n

    def checkpoint_payload(self, checkpoint: dict[int, dict[str, torch.Tensor]]) -> bytes:
        """A checkpoint (`take_captured`'s, layer -> name -> tensor) as `export_slot`'s bytes: what a tier stores."""
        parts = [checkpoint[layer][name].reshape(-1) for layer, ts in self.layers.items() for name in ts]
        return torch.cat(parts).cpu().numpy().tobytes()

    def checkpoint_from_payload(self, payload: bytes) -> dict[int, dict[str, torch.Tensor]]:
        """The checkpoint `checkpoint_payload` made; ValueError when the payload is not one of this pool's."""
        if len(payload) != self.slot_bytes():
            raise ValueError(f"a recurrent state payload of {len(payload)} bytes does not fit this pool's slots "
                             f"of {self.slot_bytes()}")
        flat, pos, out = torch.frombuffer(bytearray(payload), dtype=torch.float32), 0, {}
        for layer, tensors in self.layers.items():
            out[layer] = {}
            for name, t in tensors.items():
                n = t[0].numel()
                out[layer][name] = flat[pos:pos + n].view(t[0].shape).to(t.device)
                pos += n
        return out

    def slot_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for ts in self.layers.values() for t in ts.values())

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.layers.values() for t in ts.values())
