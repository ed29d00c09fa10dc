"""The stored form of one block outside the process: header (magic, version, key, format, sizes, checksum) + payload.

Value and metadata travel together under one key, so no store can evict one without the other; `unpack`
refuses anything whose header, length or checksum does not match, and the caller counts it as a miss.
"""
from __future__ import annotations

import struct
import zlib

from kvforge.kv.tiers.keys import BlockKey

MAGIC = b"KVFB"
VERSION = 1
_HEAD = struct.Struct("<4sHHI16sQI")  # magic, version, group, format-description length, digest, payload length, crc32


class CorruptEntry(ValueError):
    """A stored block whose header, length or checksum does not match what was asked for."""


def pack(key: BlockKey, payload: bytes, description: str) -> bytes:
    desc = description.encode()
    head = _HEAD.pack(MAGIC, VERSION, key.group, len(desc), key.digest, len(payload), zlib.crc32(payload))
    return head + desc + payload


def unpack(key: BlockKey, data: bytes, description: str) -> bytes:
    if len(data) < _HEAD.size:
        raise CorruptEntry(f"block {key.name}: {len(data)} bytes is shorter than a header ({_HEAD.size})")
    magic, version, group, desc_len, digest, size, crc = _HEAD.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise CorruptEntry(f"block {key.name}: not a kvforge block entry of version {VERSION}")
    if group != key.group or digest != key.digest:
        raise CorruptEntry(f"block {key.name}: entry holds another key")
    desc = bytes(data[_HEAD.size:_HEAD.size + desc_len]).decode(errors="replace")
    if desc != description:
        raise CorruptEntry(f"block {key.name}: stored for {desc!r}, this engine is {description!r}")
    payload = bytes(data[_HEAD.size + desc_len:])
    if len(payload) != size:
        raise CorruptEntry(f"block {key.name}: payload has {len(payload)} bytes, header says {size} (truncated?)")
    if zlib.crc32(payload) != crc:
        raise CorruptEntry(f"block {key.name}: checksum mismatch")
    return payload
