"""ngram speculation stays lossless on recurrent hybrids: the state is copied after every draft row, and a rejected
draft's effect is undone by going back to the copy after the last accepted token; prefix caching stays on."""
import pytest
import torch
from tiny_models import write_tiny_model

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.errors import ConfigError
from kvforge.models.loader import load_model
from kvforge.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "adaptive": False}


@pytest.fixture(scope="module", params=["granite-hybrid", "lfm2", "rwkv", "qwen3-next"])
def loaded(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    write_tiny_model(request.param, d)
    return load_model(str(d))


def _generate(loaded, prompts, speculative) -> tuple[list[list[int]], dict]:
    engine = LLMEngine(EngineConfig(kv_cache_memory=4 << 20, max_num_seqs=4, max_num_batched_tokens=64,
                                    speculative=speculative), loaded)
    for i, p in enumerate(prompts):
        engine.add_request(p, GREEDY, request_id=str(i))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert engine.kv.state_pool.num_used == 0
    return [outs[str(i)] for i in range(len(prompts))], engine.stats()


def test_ngram_speculation_equals_plain_decoding(loaded):
    motif = torch.randint(0, 96, (7,), generator=torch.Generator().manual_seed(3)).tolist()
    prompts = [motif * 6 + [i, i + 1] for i in range(3)] + [motif * 3 + motif[:4]]  # repeats: drafts to accept
    plain, _ = _generate(loaded, prompts, None)
    drafted, stats = _generate(loaded, prompts, SPEC)
    assert drafted == plain
    assert stats["spec_num_accepted_tokens"] > 0  # some drafts kept (a random model: few)
    assert stats["spec_num_draft_tokens"] > stats["spec_num_accepted_tokens"] + 100  # many rolled back


def test_drafters_that_run_the_target_are_refused(loaded):
    with pytest.raises(ConfigError, match="'ngram'"):
        LLMEngine(EngineConfig(kv_cache_memory=4 << 20, max_num_seqs=4, speculative={"method": "layer_skip", "num_layers": 1}), loaded)
