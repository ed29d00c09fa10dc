"""Rewrite a GGUF file with every tensor dequantized to F32 (metadata copied, file type set to ALL_F32),
so that llama.cpp computes with exactly the weights kvforge dequantizes at load time."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from kvforge.errors import ModelLoadError

ALL_F32 = 0  # llama_ftype LLAMA_FTYPE_ALL_F32


def f32_gguf_path(source: str | os.PathLike[str]) -> Path:
    """Where the F32 copy of `source` is cached (keyed by the source's path, size and modification time)."""
    src = Path(source).resolve()
    stat = src.stat()
    key = hashlib.sha256(f"{src}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "kvforge" / "gguf" / f"{src.stem}.{key}.F32.gguf"


def write_f32_gguf(source: str | os.PathLike[str], dest: str | os.PathLike[str] | None = None) -> Path:
    """The F32 copy of GGUF `source` at `dest` (default: a cache path), written unless it already exists."""
    import gguf
    from gguf.quants import dequantize

    if not str(source).endswith(".gguf") or not Path(source).is_file():
        raise ModelLoadError(f"{source!r} is not a GGUF file; the llama.cpp comparison needs a .gguf model")
    out = Path(dest) if dest else f32_gguf_path(source)
    if out.exists():
        return out
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(f".{os.getpid()}.partial")
    writer = gguf.GGUFWriter(str(partial), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    writer.add_file_type(ALL_F32)
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        writer.add_tensor(t.name, data.reshape(tuple(int(d) for d in reversed(t.shape))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(out)
    return out
