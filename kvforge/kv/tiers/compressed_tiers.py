"""CompressedTiers: compressed prompts (kvzip with reuse, kvforge.kv.compressed_prefixes) in the tiers, for the
TierConnector, so a later engine or another process adopts a context compressed once instead of scoring it again.

One entry per compressed prompt, under the key of its policy namespace (method and every option, budget included)
and its tokens (kvforge.kv.tiers.keys.KeySpace.compressed_keys: model, KV format, block size, salt as for blocks).
It holds what an adopter needs: the rows kept, the tokens they stand for, the policy's statistics (tensors and flags
only, read back with torch.load(weights_only=True)) and each block's exported bytes. Write-through tiers (disk,
Redis) get it when the prompt is compressed; write-back tiers (host) when the in-memory entry gives way. At
admission every prefix length of the prompt is a candidate (another process's contexts have lengths this one never
saw); the longest held is loaded. An entry that does not decode is a miss.
"""
from __future__ import annotations

import io
import struct
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import Any

import torch

from kvforge.kv.policies.base import PolicyState
from kvforge.kv.tiers.chain import TierChain
from kvforge.kv.tiers.keys import BlockKey, KeySpace

MAGIC = b"KVZC"
VERSION = 1
_HEAD = struct.Struct("<4sHIIII")  # magic, version, rows, tokens, blocks, policy-state bytes


@dataclass
class CompressedFetch:
    """A compressed prompt as it came from a tier."""
    num_tokens: int
    rows: int
    policy_state: PolicyState
    payloads: list[bytes]  # one per block


def encode(rows: int, num_tokens: int, policy_state: PolicyState, payloads: list[bytes]) -> bytes:
    buf = io.BytesIO()
    torch.save({f.name: _cpu(getattr(policy_state, f.name)) for f in fields(PolicyState)}, buf)
    state = buf.getvalue()
    sizes = struct.pack(f"<{len(payloads)}I", *map(len, payloads))
    return _HEAD.pack(MAGIC, VERSION, rows, num_tokens, len(payloads), len(state)) + sizes + state + b"".join(payloads)


def decode(data: bytes, num_tokens: int, block_size: int) -> CompressedFetch:
    """ValueError when `data` is not a compressed prompt of num_tokens tokens in blocks of block_size rows."""
    if len(data) < _HEAD.size:
        raise ValueError(f"compressed prompt: {len(data)} bytes is shorter than its header")
    magic, version, rows, tokens, blocks, state_len = _HEAD.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"compressed prompt: not a kvforge compressed prompt of version {VERSION}")
    if tokens != num_tokens or rows != blocks * block_size or rows > tokens:
        raise ValueError(f"compressed prompt: {rows} rows in {blocks} blocks for {tokens} tokens, expected "
                         f"{num_tokens} tokens in blocks of {block_size}")
    pos = _HEAD.size + 4 * blocks
    sizes = struct.unpack_from(f"<{blocks}I", data, _HEAD.size)
    if len(data) != pos + state_len + sum(sizes):
        raise ValueError(f"compressed prompt: {len(data)} bytes, its header says {pos + state_len + sum(sizes)}")
    saved = torch.load(io.BytesIO(data[pos:pos + state_len]), weights_only=True, map_location="cpu")
    state = PolicyState(**{f.name: saved[f.name] for f in fields(PolicyState) if f.name in saved})
    pos += state_len
    payloads = []
    for n in sizes:
        payloads.append(bytes(data[pos:pos + n]))
        pos += n
    return CompressedFetch(num_tokens, rows, state, payloads)


def _cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


class CompressedTiers:
    def __init__(self, tiers: TierChain, keys: KeySpace):
        self.tiers, self.keys = tiers, keys
        self.stored = 0  # compressed prompts queued for a tier
        self.hits = 0  # compressed prompts adopted from a tier
        self.hit_tokens = 0

    def key(self, policy: str, salt: str | None, tokens: list[int]) -> BlockKey:
        return self.keys.compressed_keys(policy, salt, tokens, [len(tokens)])[0]

    def store(self, policy: str, salt: str | None, tokens: list[int], rows: int, policy_state: PolicyState,
              payloads: list[bytes], through: bool) -> None:
        """Queue one for the write-through tiers (`through`: just compressed) or the write-back chain (it left the
        in-memory entries)."""
        if not (self.tiers.through_tiers if through else self.tiers.back_tiers):
            return
        items = [(self.key(policy, salt, tokens), encode(rows, len(tokens), policy_state, payloads))]
        if self.tiers.store_through(items) if through else self.tiers.store(items):
            self.stored += 1

    def start_load(self, policy: str, salt: str | None, tokens: list[int]) -> Future | None:
        """Look for the longest compressed strict prefix of `tokens` and fetch it: a future of a CompressedFetch
        (None: none held or unreadable), or None when the local tiers hold none (nothing to wait for)."""
        lengths = list(range(1, len(tokens)))
        if not lengths or not self.tiers.tiers:
            return None
        keys = self.keys.compressed_keys(policy, salt, tokens, lengths)
        if self.tiers.lookup_may_hang():  # Redis may be asked: look up on the load worker too
            return self.tiers.submit(lambda: self._load(keys, self.tiers.deepest(keys)))
        found = self.tiers.deepest(keys, local=True)
        return self.tiers.submit(lambda: self._load(keys, found)) if found is not None else None

    def _load(self, keys: list[BlockKey], found: tuple[int, int] | None) -> CompressedFetch | None:
        if found is None:
            return None
        i, t = found
        data = self.tiers.load([keys[i]], [t])[0]
        if data is None:
            return None
        try:
            return decode(data, i + 1, self.keys.block_size)
        except Exception:  # noqa: BLE001 - an entry that does not decode (truncated, foreign) is a miss
            return None

    def adopted(self, fetch: CompressedFetch) -> None:
        self.hits += 1
        self.hit_tokens += fetch.num_tokens

    def stats(self) -> dict:
        return {"compressed_prefixes_to_tiers": self.stored, "compressed_prefix_tier_hits": self.hits,
                "compressed_prefix_tier_hit_tokens": self.hit_tokens}
