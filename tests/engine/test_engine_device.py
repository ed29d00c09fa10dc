"""The engine computes where the model's weights are: with device unset, a model passed in keeps its device even
where CUDA is present (a CPU-loaded model on a GPU machine used to crash every step with mixed devices); a device
asked for that differs from the weights' is refused with a clear error, and nothing is moved behind the caller."""
from __future__ import annotations

import pytest
import torch

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.weights_mode import engine_device
from kvforge.errors import ConfigError
from kvforge.models.loader import load_model
from kvforge.sampling_params import SamplingParams


def test_an_unset_device_follows_a_cpu_model_where_cuda_is_present(tiny_loaded, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineConfig().resolve_device().type == "cuda"  # no model given: cuda when present
    assert engine_device(EngineConfig(), tiny_loaded) == torch.device("cpu")
    engine = LLMEngine(EngineConfig(kv_cache_memory=4 << 20, max_num_seqs=2), tiny_loaded)
    assert engine.device == torch.device("cpu")
    rid = engine.add_request([1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.request_id == rid and o.finished]
    assert finished[0].finish_reason == "length" and len(finished[0].token_ids) == 4
    engine.close()


def test_a_device_other_than_the_weights_is_refused(tiny_dir):
    loaded = load_model(tiny_dir)
    loaded.model.to("meta")
    with pytest.raises(ConfigError, match=r"weights are on meta and the engine's device is cpu.*device='cpu'"):
        LLMEngine(EngineConfig(device="cpu", kv_cache_memory=4 << 20), loaded)
    assert next(loaded.model.parameters()).device.type == "meta"  # not moved
