"""DiskTier: one file per block in a directory, under a byte budget; survives restarts; shareable by processes.

Files are written to a temporary name and renamed into place, so a reader sees a whole entry or none; with
`fsync` (the default) the file is synced before the rename and the directory after, so a power cut cannot leave
a renamed file whose bytes never reached the disk.
Each file is an entry (kvforge.kv.tiers.entry: header with key, format and checksum); a file that fails
its checks on read (truncated, corrupted, another layout) is a miss and is removed.

Only files named `<group>-<32 hex digits>.kvb` belong to the tier: they are indexed (oldest first at start, so a new
engine finds what an earlier one stored), counted against the budget and evicted; any other file is left alone.
The budget holds at every moment: room is made (least recently used files pushed out) before a file is written.
Writers share the directory through an exclusive lock on `kvforge-disk-tier.lock`, which also holds a counter of
writes: a tier that sees the counter moved since its own last write rescans the directory first, so processes
sharing one directory (with one budget) never hold more than the budget together. Removals outside the lock
(discards, corrupt files) only lower what is on disk.
"""
from __future__ import annotations

import fcntl
import itertools
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

from kvforge.errors import ConfigError
from kvforge.kv.tiers.base import Tier
from kvforge.kv.tiers.entry import CorruptEntry, pack, unpack
from kvforge.kv.tiers.keys import DIGEST_BYTES, BlockKey

SUFFIX = ".kvb"
LOCK_NAME = "kvforge-disk-tier.lock"
KEY_NAME = re.compile(rf"(\d+)-([0-9a-f]{{{2 * DIGEST_BYTES}}})")
TMP_NAME = re.compile(rf"\d+-[0-9a-f]{{{2 * DIGEST_BYTES}}}{re.escape(SUFFIX)}\.(\d+)\.\d+\.tmp")
log = logging.getLogger("kvforge.kv.tiers")
_tmp_ids = itertools.count()


def parse_name(file_name: str) -> BlockKey | None:
    """The key a tier file is named after; None for any other file."""
    m = KEY_NAME.fullmatch(file_name[:-len(SUFFIX)]) if file_name.endswith(SUFFIX) else None
    return BlockKey(int(m[1]), bytes.fromhex(m[2])) if m else None


class DiskTier(Tier):
    name = "disk"
    shared = True

    def __init__(self, directory: str, capacity_bytes: int, description: str, cold_reads: bool = False,
                 fsync: bool = True):
        self.directory, self.capacity_bytes, self.description = directory, capacity_bytes, description
        self.fsync = fsync  # each file reaches the disk before its rename, and the rename before the next write
        self.cold_reads = cold_reads  # drop each file from the page cache before reading it (benchmarks)
        self.corrupt_files = 0
        self._lock = threading.Lock()  # the index; held for dict updates only, never across I/O
        self._index: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        try:
            os.makedirs(directory, exist_ok=True)
            self._lock_fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a path under /proc, an existing file, no permission: the user's input, one line
            raise ConfigError(f"disk KV tier {directory!r}: cannot use it as a writable directory ({e.strerror}); "
                              "give a directory kvforge may create or write, e.g. disk:/var/cache/kv:100GiB") from None
        with self._directory_lock():
            self._rescan()
            self._remove(self._make_room(0))  # a smaller budget than the directory holds
            self._count_write()

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name + SUFFIX)

    def contains(self, keys):
        """A hit counts as a use (the file moves to the recent end of the index). Keys the index lacks are looked
        for on disk (another process may have written them), up to the first one that is not there."""
        with self._lock:
            out = [k.name in self._index for k in keys]
            for k, hit in zip(keys, out):
                if hit:
                    self._index.move_to_end(k.name)
        for i, k in enumerate(keys):
            if not out[i]:
                try:
                    size = os.stat(self._path(k.name)).st_size
                except FileNotFoundError:
                    break
                with self._lock:
                    self._used += size - self._index.pop(k.name, 0)
                    self._index[k.name] = size
                out[i] = True
        return out

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

    def put(self, items, private=frozenset()):
        """Write items, pushing least recently used files out first; a key already held is only touched (its
        bytes are those of the same tokens under the same namespace)."""
        pushed: list[tuple[BlockKey, bytes]] = []
        with self._directory_lock():
            self._catch_up()
            try:
                for key, payload in items:
                    if self.contains([key])[0]:
                        continue
                    data = pack(key, payload, self.description)
                    if len(data) > self.capacity_bytes:
                        pushed.append((key, payload))
                        continue
                    pushed += self._take(self._make_room(len(data)))
                    self._write(key.name, data)
                if self.fsync and items:
                    _fsync_dir(self.directory)  # once per batch: the renames above reach the disk
            finally:
                self._count_write()
        return pushed

    def _write(self, name: str, data: bytes) -> None:
        path = self._path(name)
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
            self._used += len(data)
            self._index[name] = len(data)

    def _make_room(self, size: int) -> list[str]:
        """Take least recently used files out of the index until `size` more bytes fit the budget."""
        victims = []
        with self._lock:
            while self._index and self._used + size > self.capacity_bytes:
                name, n = self._index.popitem(last=False)
                self._used -= n
                victims.append(name)
        return victims

    def _take(self, names: list[str]) -> list[tuple[BlockKey, bytes]]:
        """Read and delete pushed-out files, for the next tier."""
        out = []
        for name in names:
            key = parse_name(name + SUFFIX)
            path = self._path(name)
            try:
                with open(path, "rb") as f:
                    out.append((key, unpack(key, f.read(), self.description)))
            except (OSError, CorruptEntry):
                pass
            _remove(path)
        return out

    def _remove(self, names: list[str]) -> None:
        for name in names:
            _remove(self._path(name))

    def discard(self, keys):
        for k in keys:
            self._forget(k.name)
            _remove(self._path(k.name))

    def _forget(self, name: str) -> None:
        with self._lock:
            size = self._index.pop(name, None)
            if size is not None:
                self._used -= size

    def used_bytes(self):
        return self._used

    def close(self):
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # -- sharing the directory ---------------------------------------------------------------------

    @contextmanager
    def _directory_lock(self) -> Iterator[None]:
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _writes(self) -> int:
        data = os.pread(self._lock_fd, 8, 0)
        return int.from_bytes(data, "little") if len(data) == 8 else 0

    def _count_write(self) -> None:
        self._seen = self._writes() + 1
        os.pwrite(self._lock_fd, self._seen.to_bytes(8, "little"), 0)

    def _catch_up(self) -> None:
        """Rescan when another tier wrote to the directory since our last write (under the directory lock)."""
        if self._writes() != self._seen:
            self._rescan()

    def _rescan(self) -> None:
        """Index the tier's files as they are on disk: known ones keep their order, new ones (oldest first) go to
        the recent end, vanished ones leave. Temporary files of writers that no longer run are removed."""
        found: dict[str, tuple[int, int]] = {}
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if parse_name(entry.name) is not None and entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    found[entry.name[:-len(SUFFIX)]] = (st.st_mtime_ns, st.st_size)
                elif (m := TMP_NAME.fullmatch(entry.name)) and not _alive(int(m[1])):
                    _remove(entry.path)  # a write that never finished
        with self._lock:
            index = OrderedDict((name, found[name][1]) for name in self._index if name in found)
            for name in sorted(set(found) - set(index), key=lambda n: found[n]):
                index[name] = found[name][1]
            self._index, self._used = index, sum(index.values())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
