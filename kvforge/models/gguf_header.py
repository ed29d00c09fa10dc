"""The GGUF file format's header: metadata and the tensor table, every read bounds-checked, so a bad file gives a
ModelLoadError that says what is wrong, not a struct or numpy error. models/gguf_loader.py builds models from it.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvforge.errors import ModelLoadError

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order: ggml's dimensions reversed
    qtype: GGMLQuantizationType
    start: int  # absolute byte offset in the file
    nbytes: int


class _Cursor:
    """Reads little-endian GGUF values from a buffer, refusing to read past its end."""

    def __init__(self, buf: Any, path: str) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def take(self, n: int, what: str) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise ModelLoadError(
                f"{self.path}: truncated or corrupt GGUF: reading {what} needs bytes {start}..{start + n} "
                f"but the file has {self.size} bytes"
            )
        self.pos += n
        return start

    def scalar(self, vtype: int, what: str) -> Any:
        fmt = _SCALAR[vtype]
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar(10, what)
        start = self.take(n, what)
        try:
            return bytes(self.buf[start : start + n]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"{self.path}: corrupt GGUF: {what} at byte {start} is not UTF-8") from e

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row (a vocabulary, merges): string() without a call per bound check."""
        buf, pos, size, out = self.buf, self.pos, self.size, []
        try:
            for _ in range(count):
                n = struct.unpack_from("<Q", buf, pos)[0] if pos + 8 <= size else -1
                if n < 0 or pos + 8 + n > size:
                    self.pos = pos
                    self.string(what)  # raises with the offending offsets
                out.append(buf[pos + 8:pos + 8 + n].decode("utf-8"))
                pos += 8 + n
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"{self.path}: corrupt GGUF: {what} at byte {pos + 8} is not UTF-8") from e
        self.pos = pos
        return out

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALAR:
            return self.scalar(vtype, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype, count = self.scalar(4, what), self.scalar(10, what)
            if etype in _SCALAR:
                width = struct.calcsize(_SCALAR[etype])
                start = self.take(count * width, what)
                return np.frombuffer(self.buf, np.dtype(_SCALAR[etype]), count, start).tolist()
            if count > self.size - self.pos:
                self.take(count, what)  # raises: not even a byte per element is left
            if etype == _STRING:
                return self.strings(count, what)
            return [self.value(etype, what) for _ in range(count)]
        raise ModelLoadError(f"{self.path}: corrupt GGUF: {what} has unknown value type {vtype} (expected 0..12)")


def read_gguf_header(path: str, buf: Any) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """Metadata and the tensor table of a GGUF file; checks every tensor's data lies inside the file."""
    cur = _Cursor(buf, path)
    magic = bytes(buf[: cur.take(4, "the magic number") + 4])
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file: starts with {magic!r}, expected b'GGUF'")
    version = cur.scalar(4, "the version")
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported; supported: 2, 3 (little-endian)")
    n_tensors, n_kv = cur.scalar(10, "the tensor count"), cur.scalar(10, "the metadata count")
    if n_tensors > cur.size or n_kv > cur.size:
        raise ModelLoadError(f"{path}: corrupt GGUF header: {n_tensors} tensors, {n_kv} metadata entries")
    meta: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        meta[key] = cur.value(cur.scalar(4, f"the type of {key}"), f"metadata value {key}")
    table = []
    for i in range(n_tensors):
        name = cur.string(f"tensor name #{i}")
        n_dims = cur.scalar(4, f"the rank of {name}")
        if n_dims > 8:
            raise ModelLoadError(f"{path}: corrupt GGUF: tensor {name} claims {n_dims} dimensions (at most 8)")
        dims = [cur.scalar(10, f"the shape of {name}") for _ in range(n_dims)]
        table.append((name, tuple(reversed(dims)), cur.scalar(4, f"the type of {name}"), cur.scalar(10, name)))
    alignment = meta.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ModelLoadError(f"{path}: corrupt GGUF: general.alignment is {alignment!r}, expected a positive int")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = [_tensor(path, data_start, *entry) for entry in table]
    needed = max((t.start + t.nbytes for t in tensors), default=0)
    if needed > cur.size:
        first = next(t for t in tensors if t.start + t.nbytes > cur.size)
        raise ModelLoadError(
            f"{path}: truncated GGUF: the file has {cur.size} bytes but its tensors need {needed} "
            f"(tensor {first.name} needs bytes {first.start}..{first.start + first.nbytes})"
        )
    return meta, tensors


def _tensor(path: str, data_start: int, name: str, shape: tuple[int, ...], type_id: int, offset: int) -> GGUFTensor:
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise ModelLoadError(f"{path}: tensor {name} has unknown ggml type {type_id}") from None
    block, type_size = GGML_QUANT_SIZES[qtype]
    if shape and shape[-1] % block:
        raise ModelLoadError(f"{path}: tensor {name}: row length {shape[-1]} is not a multiple of {qtype.name} "
                             f"block size {block}")
    return GGUFTensor(name, shape, qtype, data_start + offset, math.prod(shape) // block * type_size)


def open_gguf(path: str) -> Any:
    """The file memory-mapped read-only; ModelLoadError when it is missing, empty or unreadable."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: no such file; expected a .gguf model file")
    if os.path.getsize(path) == 0:
        raise ModelLoadError(f"{path}: the file is empty; expected a GGUF model file")
    try:
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read the file ({e})") from e
