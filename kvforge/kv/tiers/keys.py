"""Content keys of KV blocks: a hash chain over whole blocks of token ids, seeded with a namespace.

namespace = blake2b(json of {version, weights fingerprint, format name and options, block size, layer spec, salt})
key[0]    = blake2b(namespace || tokens of block 0 as little-endian int64)
key[i]    = blake2b(key[i-1]  || tokens of block i)
A block's key thus names its whole prefix. Every input is bytes fixed by the model and the prompt (no Python
`hash()`, no per-process seed), so every process computes the same key, and a different model, format, option,
block size or tenant salt never matches. Entries are addressed by (KV group index, key).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvforge.kv.layer_format import KVFormat
from kvforge.kv.spec import KVCacheSpec

KEY_VERSION = 1
DIGEST_BYTES = 16
SAMPLES_PER_TENSOR = 4096


@dataclass(frozen=True)
class BlockKey:
    group: int
    digest: bytes

    @property
    def name(self) -> str:
        """The key as text (file names, Redis keys): '<group>-<hex digest>'."""
        return f"{self.group}-{self.digest.hex()}"


def _hash(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for p in parts:
        h.update(p)
    return h.digest()


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A stable digest of a model's weights: every tensor's name, shape, dtype and an even sample of its values."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for name, t in sorted(model.state_dict().items()):
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // SAMPLES_PER_TENSOR)
        sample = flat[::step].contiguous().cpu()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return h.hexdigest()


def format_options(fmt: KVFormat) -> dict:
    return dataclasses.asdict(fmt) if dataclasses.is_dataclass(fmt) else {}


class KeySpace:
    """Computes block keys for one engine: its weights, KV format (with options), block size and layer spec."""

    def __init__(self, weights: str, fmt: KVFormat, block_size: int, spec: KVCacheSpec):
        self.block_size = block_size
        self.description = {"version": KEY_VERSION, "weights": weights, "format": fmt.name,
                            "format_options": format_options(fmt), "block_size": block_size,
                            "spec": dataclasses.asdict(spec)}

    def namespace(self, salt: str | None) -> bytes:
        text = json.dumps({**self.description, "salt": salt}, sort_keys=True, default=str)
        return _hash(text.encode())

    def chain(self, tokens: Sequence[int], salt: str | None, group: int = 0) -> list[BlockKey]:
        """Keys of every whole block of `tokens` (a partly filled last block has none)."""
        bs = self.block_size
        n = len(tokens) // bs
        ids = np.asarray(tokens[: n * bs], dtype="<i8")
        parent, keys = self.namespace(salt), []
        for i in range(n):
            parent = _hash(parent, ids[i * bs:(i + 1) * bs].tobytes())
            keys.append(BlockKey(group, parent))
        return keys
