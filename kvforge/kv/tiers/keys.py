"""Content keys of KV blocks: a hash chain over whole blocks of token ids, seeded with a namespace.

namespace = blake2b(sorted-key json of {
                key version (KEY_VERSION), KV layout version (the pool's export layout, kv/pool.py),
                model: {weights fingerprint (names, shapes, dtypes and a sample of every tensor),
                        config (every field of the model's config as loaded: RoPE base and scaling, norms, windows,
                                soft-caps, ...), weights mode (fp32 | int8),
                        draft: the draft model's {weights, config, weights mode} where one is used, else null},
                format name and options, block size, layer spec, salt,
                states: a recurrent model's state groups (kind, layers, shapes) and their dtype, else absent})
key[0]    = blake2b(namespace || tokens of block 0 as little-endian int64)
key[i]    = blake2b(key[i-1]  || tokens of block i)
A block's key thus names its whole prefix and everything that changes its K/V. Every input is bytes fixed by the
model and the prompt (no Python `hash()`, no per-process seed), so every process computes the same key, and a
different model, config, weights mode, draft, format, option, block size or tenant salt never matches. Entries are
addressed by (KV group index, key). A recurrent model's state checkpoint after block i is the entry
(STATE_GROUP, blake2b("state" || key[i])): the same chain (model, KV format, salt, tokens), in a group of its own.
A compressed prompt (kvforge.kv.tiers.compressed_tiers) of n tokens is the entry (COMPRESSED_GROUP,
blake2b(namespace || "compressed" || len || policy namespace || its n tokens)): the policy namespace names the
method and every option (budget included), so another method or budget never matches.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvforge.kv.layer_format import KVFormat
from kvforge.kv.pool import LAYOUT_VERSION
from kvforge.kv.spec import KVCacheSpec

KEY_VERSION = 2
DIGEST_BYTES = 16
SAMPLES_PER_TENSOR = 4096
STATE_GROUP = 255  # the entry group of recurrent state checkpoints (KV blocks are group 0)
COMPRESSED_GROUP = 254  # the entry group of compressed prompts (kvzip with reuse)
STATE_DTYPE = "float32"  # how a checkpoint's tensors are stored (kvforge.kv.state_pool.StatePool.checkpoint_payload)


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


def canonical(value: Any) -> Any:
    """`value` as plain JSON data (dataclasses and mappings as dicts, tuples as lists), the same in every process."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)  # dtypes, enums: their names


@dataclass(frozen=True)
class ModelKey:
    """What a model contributes to its K/V: weights, configuration as loaded, weights mode, and its draft model."""
    weights: str  # weights_fingerprint
    config: Any  # the model's config object (a dataclass) or a mapping
    weights_mode: str = "fp32"
    draft: ModelKey | None = None

    @classmethod
    def of(cls, model: torch.nn.Module, config: Any, weights_mode: str = "fp32",
           draft: ModelKey | None = None) -> ModelKey:
        return cls(weights_fingerprint(model), config, weights_mode, draft)

    def describe(self) -> dict:
        return {"weights": self.weights, "config": canonical(self.config), "weights_mode": self.weights_mode,
                "draft": self.draft.describe() if self.draft is not None else None}


def format_options(fmt: KVFormat) -> dict:
    return dataclasses.asdict(fmt) if dataclasses.is_dataclass(fmt) else {}


class KeySpace:
    """Computes block keys for one engine: its model (ModelKey), KV format (with options), block size and layer spec,
    and a recurrent model's state groups (`states`, kvforge.kv.groups.StateGroup), whose checkpoints have keys too."""

    def __init__(self, model: ModelKey, fmt: KVFormat, block_size: int, spec: KVCacheSpec, states: Sequence = ()):
        self.block_size = block_size
        self.description = {"version": KEY_VERSION, "layout": LAYOUT_VERSION, "model": model.describe(),
                            "format": fmt.name, "format_options": canonical(format_options(fmt)),
                            "block_size": block_size, "spec": canonical(spec)}
        if states:
            self.description["states"] = {"groups": canonical(list(states)), "dtype": STATE_DTYPE}

    def namespace(self, salt: str | None) -> bytes:
        text = json.dumps({**self.description, "salt": salt}, sort_keys=True, allow_nan=True)
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

    def state_key(self, block_key: BlockKey) -> BlockKey:
        """The key of the state checkpoint taken after the block `block_key` names (its whole prefix)."""
        return BlockKey(STATE_GROUP, _hash(b"state", block_key.digest))

    def compressed_keys(self, policy: str, salt: str | None, tokens: Sequence[int], lengths: Sequence[int]
                        ) -> list[BlockKey]:
        """The keys of the compressed prompts `tokens[:n]`, n in `lengths` (ascending), under the policy namespace
        `policy` (kvforge.kv.policies.base.KVPolicy.namespace)."""
        name = policy.encode()
        h = hashlib.blake2b(digest_size=DIGEST_BYTES)
        h.update(self.namespace(salt) + b"compressed" + len(name).to_bytes(4, "little") + name)
        ids, keys, done = np.asarray(tokens, dtype="<i8"), [], 0
        for n in lengths:
            h.update(ids[done:n].tobytes())
            done = n
            keys.append(BlockKey(COMPRESSED_GROUP, h.copy().digest()))
        return keys
