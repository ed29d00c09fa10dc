"""KV storage formats by name: the plain dtypes here, the quantized ones from kvforge.kv.quant."""
from __future__ import annotations

from typing import ClassVar

import torch

from kvforge.errors import ConfigError
from kvforge.kv.block_bytes import (
    LayerRows,
    flag_column,
    nbytes,
    put_rows,
    rows_as_bytes,
    stack_payloads,
    tensor_from_columns,
)
from kvforge.kv.layer_format import KVFormat, LayerKV, RawKV, RawSide
from kvforge.kv.lazy_zeros import lazy_zeros
from kvforge.kv.model_defaults import model_format_options
from kvforge.kv.quant import fp8, int4, int8, kivi2  # noqa: F401  (registered on import)
from kvforge.kv.spec import KVCacheSpec
from kvforge.options import json_object


class PlainLayerKV(LayerKV):
    def __init__(self, spec: KVCacheSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        shape = (num_blocks, block_size, spec.num_kv_heads)
        self.k = lazy_zeros(*shape, spec.head_dim, dtype=dtype, device=device)
        self.v = lazy_zeros(*shape, spec.v_head_dim, dtype=dtype, device=device) if spec.has_values else None

    def write(self, slots, k, v, positions=None):
        self.k.view(-1, *self.k.shape[2:])[slots] = k.to(self.k.dtype)
        if self.v is not None:
            self.v.view(-1, *self.v.shape[2:])[slots] = v.to(self.v.dtype)

    def gather(self, block_ids):
        k = self.k.index_select(0, block_ids).flatten(0, 1).float()
        v = self.v.index_select(0, block_ids).flatten(0, 1).float() if self.v is not None else None
        return k, v

    def tensors(self):
        return [t for t in (self.k, self.v) if t is not None]

    def plain_rows(self):
        return (self.k, self.v) if self.v is not None else None

    def raw(self):
        return RawKV(RawSide("plain", [self.k]), RawSide("plain", [self.v])) if self.v is not None else None

    def _sides(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v) if t is not None]

    def export_blocks(self, block_ids):
        ids = block_ids.long()
        return LayerRows([flag_column(len(ids))] + [rows_as_bytes(t.index_select(0, ids)) for t in self._sides()])

    def import_rows(self, block_ids, table):
        pos = 1
        for t in self._sides():
            put_rows(t, block_ids.long(), tensor_from_columns(table, pos, t.shape[1:], t.dtype, t.device))
            pos += nbytes(t.shape[1:], t.dtype)

    def import_blocks(self, block_ids, payloads):
        self.import_rows(block_ids, stack_payloads(payloads))

    def payload_bytes(self, flag):
        return 1 + sum(nbytes(t.shape[1:], t.dtype) for t in self._sides())


class PlainFormat(KVFormat):
    dtype: ClassVar[torch.dtype]

    def layer_block_bytes(self, spec, block_size):
        return block_size * spec.elements_per_token_per_layer * self.dtype.itemsize

    def allocate(self, spec, num_blocks, block_size, device, max_num_seqs=1):
        return PlainLayerKV(spec, num_blocks, block_size, self.dtype, device)


class FP32(PlainFormat):
    """Full precision; the default on CPU."""

    name = "fp32"
    dtype = torch.float32


class FP16(PlainFormat):
    """IEEE half storage, compute in fp32."""

    name = "fp16"
    dtype = torch.float16


class BF16(PlainFormat):
    """bfloat16 storage, compute in fp32."""

    name = "bf16"
    dtype = torch.bfloat16


def format_names() -> list[str]:
    """Every format name: the plain dtypes (widest first), then the quantized ones by name."""
    plain = [n for n, c in KVFormat.registry.items() if issubclass(c, PlainFormat)]
    return plain + sorted(n for n in KVFormat.registry if n not in plain)


def get_format(name: str, **options) -> KVFormat:
    """The format called `name`, built with its options (e.g. group_size)."""
    cls = KVFormat.registry.get(name)
    if cls is None:
        allowed = ", ".join(sorted(KVFormat.registry))
        raise ConfigError(f"unknown kv_cache_dtype {name!r}; allowed: {allowed}")
    try:
        return cls(**options)
    except TypeError as e:
        raise ConfigError(f"kv_cache_dtype {name!r} does not take options {sorted(options)}: {e}") from None


def format_for_model(name: str, options: dict | None = None, config=None) -> KVFormat:
    """The format `name` for a model (config: its ModelConfig; None for none in particular): the model's recorded
    defaults (kv/model_defaults.py) overridden by `options`."""
    arch, hidden = getattr(config, "arch", None), getattr(config, "hidden_size", None)
    return get_format(name, **model_format_options(name, options, arch, hidden))


def parse_format_spec(text: str) -> tuple[str, dict]:
    """'int4' or 'int4:{"group_size": 32}' -> (name, options)."""
    name, _, raw = text.partition(":")
    return name, json_object(f"format {text!r}: the options after ':'", raw, 'int4:{"group_size": 32}')

__all__ = ["BF16", "FP16", "FP32", "KVFormat", "LayerKV", "PlainFormat", "PlainLayerKV", "format_for_model", "format_names", "get_format",
           "parse_format_spec"]
