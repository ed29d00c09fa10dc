"""models/weight_store.py: an engine holds each weight in the layouts its kernels read and no other copy, the bytes
it reports are the storages it really holds, the calculator's planned bytes equal them, and steps make no copy."""
import pytest
import torch
from tiny_models import write_tiny_model

from kvforge import SamplingParams
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.models.loader import load_model
from kvforge.models.weight_store import linear_weights, planned_bytes, resident_bytes, resident_tensors
from kvforge.ops.packed_weights import ATTRIBUTE as ONEDNN


def _storages(model) -> dict[int, int]:
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in resident_tensors(model)
            if t.device.type != "meta"}


def _panel_bytes(n: int, k: int) -> int:
    return -(-n // 16) * 16 * k * 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-gqa")
    write_tiny_model("llama-gqa", path)
    return str(path)


def test_fp32_engine_holds_the_loaded_weights_plus_one_panel_copy_of_each_linear_weight(tiny):
    loaded = load_model(tiny)
    as_loaded = resident_bytes(loaded.model)
    cfg = loaded.config
    h, inter, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = _panel_bytes(q + 2 * kv, h) + _panel_bytes(h, q) + _panel_bytes(2 * inter, h) + _panel_bytes(h, inter)
    engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 22), loaded)
    expected = as_loaded + cfg.num_layers * per_layer + _panel_bytes(cfg.vocab_size, h)
    assert engine.weight_bytes == engine.stats()["weight_bytes"] == expected
    assert sum(_storages(engine.loaded.model).values()) == expected
    assert planned_bytes(cfg, "fp32") == expected


@pytest.mark.parametrize("kind", ["llama-mqa", "gemma3"])
def test_a_tied_lm_head_is_held_once_row_major_and_steps_make_no_copy_of_it(kind, tmp_path):
    """The embedding lookup reads the table row-major, so an LM head tied to it gets no panel copy beside it
    (Gemma 3 270M: 640 MiB), neither at build nor on a step of many rows."""
    from kvforge.ops.panels import ATTRIBUTE as PANELS

    write_tiny_model(kind, tmp_path)
    loaded = load_model(str(tmp_path))
    cfg, model = loaded.config, loaded.model
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 22, max_num_seqs=40), loaded)
    panel_copies = sum(getattr(w, PANELS).nbytes for w in linear_weights(model) if w is not model.lm_head.weight)
    assert engine.weight_bytes == resident_bytes(loaded.model) == planned_bytes(cfg, "fp32")
    row_major = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers())}
    assert engine.weight_bytes == sum(row_major.values()) + panel_copies
    _run(engine, [[1 + i % 7, 2, 3] for i in range(40)], 2)  # 40 rows through the LM head at once
    assert getattr(model.lm_head.weight, PANELS, None) is None and engine.weight_bytes == resident_bytes(model)


@pytest.mark.parametrize("kind", ["llama-gqa", "gemma3"])
def test_int8_engine_holds_less_than_fp32_and_what_the_calculator_plans(kind, tmp_path):
    write_tiny_model(kind, tmp_path)
    fp32 = LLMEngine(EngineConfig(kv_cache_memory=1 << 22), load_model(str(tmp_path)))
    int8 = LLMEngine(EngineConfig(kv_cache_memory=1 << 22, weights="int8"), load_model(str(tmp_path)))
    assert int8.weight_bytes == sum(_storages(int8.loaded.model).values()) == planned_bytes(int8.model_config, "int8")
    assert fp32.weight_bytes == planned_bytes(fp32.model_config, "fp32")
    assert int8.weight_bytes < fp32.weight_bytes


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0), request_id=str(i))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_steps_make_no_weight_copy(tiny, weights):
    """A prefill step of 600 rows (two prompts), then batched decode of 10 sequences and one alone: the set of
    storages the model holds is the one the engine was built with (no oneDNN copy, no dequantized copy)."""
    engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 22, weights=weights), load_model(tiny))
    before = _storages(engine.loaded.model)
    gen = torch.Generator().manual_seed(0)
    _run(engine, [torch.randint(0, 96, (300,), generator=gen).tolist() for _ in range(2)], 2)
    _run(engine, [torch.randint(0, 96, (5,), generator=gen).tolist() for _ in range(10)], 4)
    _run(engine, [[1, 2, 3]], 4)
    assert _storages(engine.loaded.model) == before
    assert not any(hasattr(t, ONEDNN) for t in resident_tensors(engine.loaded.model))


def test_the_kv_budget_is_sized_after_every_layout_exists(tmp_path, monkeypatch):
    """qwen3 (q/k norms: the layer bridge does not serve it) multiplies through ops `linear` too: its panels exist
    before the engine reads the free memory its KV pool is sized from, and steps add none."""
    from kvforge.engine import kv_budget

    write_tiny_model("qwen3", tmp_path)
    loaded = load_model(str(tmp_path))
    seen = []
    monkeypatch.setattr(kv_budget, "free_memory_bytes", lambda device: seen.append(resident_bytes(loaded.model))
                        or 64 << 20)
    engine = LLMEngine(EngineConfig(kv_cache_memory_fraction=0.5), loaded)
    _run(engine, [list(range(1, 40)) for _ in range(9)], 3)
    assert seen == [engine.weight_bytes] == [resident_bytes(loaded.model)]
    assert engine.weight_bytes > resident_bytes(load_model(str(tmp_path)).model)  # panels counted
