"""The one owner of a model's weights in the layouts its kernels read.

Rules, applied when an engine is built (`prepare_weights`) and, for a model not loaded, to its meta-device twin
(`planned_bytes`), so the memory calculator and the engine count by the same code:
- fp32: every tensor stays as loaded (row-major: the embedding lookup, small_linear and the layer bridge's few-row
  path read it), and each weight the model multiplies through `ops.layers.linear` (`linear_weights`) also gets
  its panel copy (ops/panels.py), which every step of more rows reads, prefill included, except an LM head tied to
  the embedding: the lookup reads that table row-major, so it stays the one copy (marked NO_PANELS; the head runs
  small_linear up to 32 rows, BLAS above). No other copy is made.
- int8 (models/int8_weights.py): each quantized weight is held as int8 only, in the int8 operator's packed layout
  (decode's few rows) and as int8 panels (more rows), with one scale per row; its fp32 original is released (the
  tensor object stays on the meta device, so shapes and state dicts still work), other tensors (embedding, norms,
  biases) stay as loaded.
- GGUF blocks (models/quant_weights.py, `weights="auto"` on a GGUF file): each Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weight is
  held as its file's block bytes only (its kernels read them in place: no panels, no fp32 copy), fused projections
  as one block tensor whose parts are views; other tensors as fp32. A Q8_0 LM head is repacked into the few-row
  kernel's lane groups (ops/q8_lanes.py: the same bytes, so `planned_bytes` counts it as stored).
`resident_bytes` sums the storages a model really holds, each once; the engine reports it, and its free-memory
sizing sees every copy, since all exist before the KV pool is sized.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from kvforge.models.config import ModelConfig
from kvforge.models.int8_weights import INT8, RELEASED, int8_panels, quantize_model, quantized_weights
from kvforge.models.int8_weights import PANELS as INT8_PANELS
from kvforge.models.quant_weights import adopt_block_modules, attach_blocks, blocks_of, repack_head
from kvforge.ops.packed_weights import ATTRIBUTE as ONEDNN
from kvforge.ops.panels import ATTRIBUTE as PANELS
from kvforge.ops.panels import NO_PANELS, panels

LAYOUTS = (PANELS, ONEDNN, INT8_PANELS)  # attributes of a weight tensor that hold another layout of it
ALIGN = 64  # int8 packed weights share one buffer, each from a 64-byte boundary (ops/int8.py in_huge_pages)


def linear_weights(model: nn.Module) -> list[torch.Tensor]:
    """The fp32 weights the model multiplies through ops.layers.linear, as its modules declare them
    (`linear_weights()`: fused q/k/v and gate/up, attention and MLP output projections, an LM head)."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        declared = getattr(module, "linear_weights", None)
        for w in declared() if callable(declared) else []:
            if w is not None and getattr(w, INT8, None) is None and blocks_of(w) is None:
                found[id(w)] = w
    return list(found.values())


@torch.no_grad()
def prepare_weights(model: nn.Module) -> None:
    """Make every layout the model's kernels read now (panels of each fp32 linear weight, the int8 panels of each int8
    one), so no step stalls packing and the free memory the KV pool is sized from already counts them. A weight that
    is also an embedding table (a tied LM head) keeps its one row-major copy."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for w in linear_weights(model):
        if id(w) in tables:
            setattr(w, NO_PANELS, True)
        elif w.dim() == 2 and w.dtype == torch.float32 and w.device.type in ("cpu", "meta"):
            panels(w)
    for w in quantized_weights(model):
        int8_panels(w)
    repack_head(model)


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    for module in model.modules():
        for t in (*module._parameters.values(), *module._buffers.values(), *vars(module).values()):
            if isinstance(t, torch.Tensor):
                yield t


def resident_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor holding the model's weights: parameters, buffers, tensor attributes and the other layouts
    attached to them (released fp32 originals left out)."""
    out = []
    for t in _tensors(model):
        if not getattr(t, RELEASED, False):
            out.append(t)
        out.extend(getattr(t, name) for name in LAYOUTS if getattr(t, name, None) is not None)
        out.extend(getattr(t, INT8, None) or ())
        if blocks_of(t) is not None:
            out.append(blocks_of(t).data)
    return out


def resident_bytes(model: nn.Module) -> int:
    """Bytes of the distinct storages the model holds: shared, fused and tied weights once. A meta-device model
    (planned_bytes) counts what its real twin would hold, int8 packed weights at 64-byte boundaries."""
    int8 = {id(t) for w in quantized_weights(model) for t in getattr(w, INT8)[:1]}
    storages: dict[int, int] = {}
    for t in resident_tensors(model):
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if t.device.type == "meta" and id(t) in int8:
            nbytes = -(-nbytes // ALIGN) * ALIGN
        storages[storage._cdata] = nbytes
    return sum(storages.values())


def planned_bytes(cfg: ModelConfig, weights: str = "fp32", gguf_path: str | None = None) -> int:
    """The bytes an engine with these weights (`auto`, `fp32` or `int8`) would hold for this model, from its config
    (and for `auto`, a GGUF file's tensor table): the model built on the meta device, the same rules applied, its
    storages counted. `auto` without a GGUF file holds fp32 weights."""
    from kvforge.models.loader import model_class

    blocks = {}
    if weights == "auto" and gguf_path is not None:
        from kvforge.models.gguf_loader import block_table

        blocks = block_table(gguf_path)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
        if blocks:
            attach_blocks(model, blocks)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        adopt_block_modules(model)
        model.init_buffers()
        model.eval()
        if weights == "int8":
            quantize_model(model)
        prepare_weights(model)
    return resident_bytes(model)
