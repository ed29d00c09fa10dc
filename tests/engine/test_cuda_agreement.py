"""On a CUDA machine (skipped elsewhere): greedy tokens of tiny random models of each family, the engine on cuda
against the engine on cpu with the same weights, for fp32, int8, int4 and fp16 KV."""
from __future__ import annotations

import pytest
import torch
from tiny_models import write_tiny_model

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.models.loader import load_model
from kvforge.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PROMPTS = [list(range(1, 40)), list(range(5, 70)), [3, 1, 4, 1, 5, 9, 2, 6]]
FORMATS = [{}, {"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "int4", "kv_cache_options": {"group_size": 16}},
           {"kv_cache_dtype": "fp16"}]


def _greedy(model_dir, device: str, **options) -> list[tuple[list[int], str]]:
    engine = LLMEngine(EngineConfig(device=device, kv_cache_memory=16 << 20, max_num_seqs=4, max_num_batched_tokens=64,
                                    **options), load_model(model_dir, device))
    rids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) for p in PROMPTS]
    out = {}
    while engine.has_unfinished_requests():
        out.update({o.request_id: (o.token_ids, o.finish_reason) for o in engine.step() if o.finished})
    engine.close()
    return [out[r] for r in rids]


@pytest.mark.parametrize("options", FORMATS, ids=["fp32", "int8", "int4", "fp16"])
@pytest.mark.parametrize("kind", ["llama-gqa", "gemma2", "qwen3", "granite-hybrid", "lfm2", "deepseek-v2"])
def test_cuda_tokens_equal_cpu_tokens(kind, options, tmp_path):
    write_tiny_model(kind, tmp_path)
    assert _greedy(tmp_path, "cuda", **options) == _greedy(tmp_path, "cpu", **options)
