"""What the router matches on: a request's prompt cut into chained chunk hashes (stable across processes).

The key is read from the request body before tokenizing, so it works on the ingress: token-id prompts are cut
every CHUNK_TOKENS ids, text prompts and chat messages every CHUNK_CHARS characters (about as many tokens).
Nothing here raises on what a client sent: a body the app will refuse (bad JSON, ids that are not token ids, odd
message parts) has no key or fewer chunks, is routed anywhere, and the app's validation answers it.
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable

CHUNK_TOKENS = 16
CHUNK_CHARS = 64
MAX_ROUTED_ID = 2**31 - 1  # ids above any vocabulary's; each id is hashed as 4 bytes
RoutingKey = str | list[int]


def routing_key(path: str, body: bytes) -> RoutingKey | None:
    """The prompt of a completions or chat request (None for other routes or bodies that do not parse)."""
    if not path.endswith(("/completions", "/chat/completions")) or not body:
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError; RecursionError: nested too deep
        return None
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("messages"), list):
        return "".join(_message_text(m) for m in data["messages"])
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if isinstance(prompt[0], (str, list)) else prompt  # a batch is routed by its first prompt
    if isinstance(prompt, str) or (isinstance(prompt, list) and token_ids(prompt)):
        return prompt or None
    return None


def token_ids(key: list) -> bool:
    """Whether every item is an int id that hashes as 4 bytes (booleans and huge ids are not: the app refuses them)."""
    return all(type(t) is int and 0 <= t <= MAX_ROUTED_ID for t in key)


def _message_text(m) -> str:
    if not isinstance(m, dict):
        return ""
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return f"<{m.get('role')}>{content if isinstance(content, str) else ''}"


def chunk_hashes(key: RoutingKey) -> list[str]:
    """Chained hashes of the key's whole chunks: equal lists up to i mean equal prompts up to chunk i.
    A key that is neither text nor routable token ids has none."""
    if not isinstance(key, (str, list)) or isinstance(key, list) and not token_ids(key):
        return []
    size = CHUNK_TOKENS if isinstance(key, list) else CHUNK_CHARS
    hashes, parent = [], b""
    for start in range(0, len(key) - size + 1, size):
        piece = key[start:start + size]
        data = (piece.encode("utf-8", "surrogatepass") if isinstance(piece, str)  # JSON may hold lone surrogates
                else b"".join(t.to_bytes(4, "little") for t in piece))
        parent = hashlib.blake2b(parent + data, digest_size=8).digest()
        hashes.append(parent.hex())
    return hashes


class ChunkSet:
    """The chunk hashes one replica holds, least recently used first; bounded like the cache it stands for."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._chunks: OrderedDict[str, None] = OrderedDict()

    def add(self, hashes: Iterable[str]) -> None:
        for h in hashes:
            self._chunks[h] = None
            self._chunks.move_to_end(h)
        while len(self._chunks) > self.capacity:
            self._chunks.popitem(last=False)

    def discard(self, hashes: Iterable[str]) -> None:
        for h in hashes:
            self._chunks.pop(h, None)

    def __contains__(self, h: str) -> bool:
        return h in self._chunks

    def __len__(self) -> int:
        return len(self._chunks)

    def newest(self, n: int) -> list[str]:
        return list(self._chunks)[-n:] if n else []


def matched_chunks(hashes: list[str], *held) -> int:
    """How many leading chunks of `hashes` are in any of the `held` sets."""
    n = 0
    for h in hashes:
        if not any(h in s for s in held):
            break
        n += 1
    return n
