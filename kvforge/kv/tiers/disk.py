"""DiskTier: one file per block in a directory, under a byte budget; survives restarts.

Files are written to a temporary name and renamed into place, so a reader sees a whole entry or none; with
`fsync` (the default) the file is synced before the rename and the directory after, so a power cut cannot leave
a renamed file whose bytes never reached the disk.
Each file is an entry (kvforge.kv.tiers.entry: header with key, format and checksum); a file that fails
its checks on read (truncated, corrupted, another layout) is a miss and is removed. At start the tier
indexes the files already there, oldest first, so a new engine finds what an earlier one stored.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import OrderedDict

from kvforge.kv.tiers.base import Tier
from kvforge.kv.tiers.entry import CorruptEntry, pack, unpack
from kvforge.kv.tiers.keys import BlockKey

SUFFIX = ".kvb"
log = logging.getLogger("kvforge.kv.tiers")
_tmp_ids = itertools.count()


class DiskTier(Tier):
    name = "disk"
    shared = True

    def __init__(self, directory: str, capacity_bytes: int, description: str, cold_reads: bool = False,
                 fsync: bool = True):
        self.directory, self.capacity_bytes, self.description = directory, capacity_bytes, description
        self.fsync = fsync  # each file reaches the disk before its rename, and the rename before the next write
        self.cold_reads = cold_reads  # drop each file from the page cache before reading it (benchmarks)
        self.corrupt_files = 0
        os.makedirs(directory, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()
        found = []
        for entry in os.scandir(directory):
            if entry.name.endswith(SUFFIX) and entry.is_file():
                st = entry.stat()
                found.append((st.st_mtime_ns, entry.name[: -len(SUFFIX)], st.st_size))
            elif entry.name.endswith(".tmp"):
                _remove(entry.path)  # a write that never finished
        for _, name, size in sorted(found):
            self._index[name] = size
        self._used = sum(self._index.values())

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name + SUFFIX)

    def contains(self, keys):
        """A hit counts as a use (the file moves to the recent end of the index). A file another process wrote
        since this one indexed the directory is a hit too, and joins the index."""
        with self._lock:
            out = [k.name in self._index for k in keys]
            for k, hit in zip(keys, out):
                if hit:
                    self._index.move_to_end(k.name)
        return [hit or self._adopt(k.name) for k, hit in zip(keys, out)]

    def _adopt(self, name: str) -> bool:
        try:
            size = os.stat(self._path(name)).st_size
        except OSError:
            return False
        with self._lock:
            if name not in self._index:
                self._index[name] = size
                self._used += size
        return True

    def get(self, keys):
        return [self._get_one(k) for k in keys]

    def _get_one(self, key: BlockKey) -> bytes | None:
        path = self._path(key.name)
        try:
            with open(path, "rb") as f:
                if self.cold_reads:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                data = f.read()
            payload = unpack(key, data, self.description)
        except FileNotFoundError:
            self._forget(key.name)
            return None
        except CorruptEntry as e:
            log.warning("KV disk tier: %s; file removed", e)
            self.corrupt_files += 1
            self._forget(key.name)
            _remove(path)
            return None
        with self._lock:
            if key.name in self._index:
                self._index.move_to_end(key.name)
        return payload

    def put(self, items):
        pushed: list[tuple[BlockKey, bytes]] = []
        for key, payload in items:
            data = pack(key, payload, self.description)
            if len(data) > self.capacity_bytes:
                pushed.append((key, payload))
                continue
            path = self._path(key.name)
            tmp = f"{path}.{os.getpid()}.{next(_tmp_ids)}.tmp"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    if self.fsync:
                        os.fsync(f.fileno())
                os.replace(tmp, path)
            except OSError:
                _remove(tmp)
                raise
            with self._lock:
                self._used += len(data) - self._index.pop(key.name, 0)
                self._index[key.name] = len(data)
                victims = []
                while self._used > self.capacity_bytes and len(self._index) > 1:
                    name, size = self._index.popitem(last=False)
                    self._used -= size
                    victims.append(name)
            pushed += self._take(victims)
        if self.fsync and items:
            _fsync_dir(self.directory)  # once per batch: the renames above reach the disk
        return pushed

    def _take(self, names: list[str]) -> list[tuple[BlockKey, bytes]]:
        """Read and delete pushed-out files, for the next tier."""
        out = []
        for name in names:
            group, _, digest = name.partition("-")
            key = BlockKey(int(group), bytes.fromhex(digest))
            path = self._path(name)
            try:
                with open(path, "rb") as f:
                    out.append((key, unpack(key, f.read(), self.description)))
            except (OSError, CorruptEntry):
                pass
            _remove(path)
        return out

    def discard(self, keys):
        for k in keys:
            with self._lock:
                held = k.name in self._index
            if held:
                self._forget(k.name)
                _remove(self._path(k.name))

    def _forget(self, name: str) -> None:
        with self._lock:
            size = self._index.pop(name, None)
            if size is not None:
                self._used -= size

    def used_bytes(self):
        return self._used


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
