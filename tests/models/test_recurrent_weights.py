"""weights="int8" and "q8_0" on the recurrent and hybrid models loaded from a Hugging Face directory compute as the
fp32 model holding the same (dequantized) weights; "auto" on a directory is fp32."""
import copy

import pytest
import torch
from tiny_models import tiny_maker

from kvforge import LLM, SamplingParams
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.scoring import position_logits
from kvforge.models.int8_weights import Int8Linear
from kvforge.models.loader import load_model
from kvforge.models.quant_weights import QBlockLinear
from kvforge.ops import qblocks

KINDS = ["granite-hybrid", "mamba2", "lfm2", "rwkv", "qwen3-next"]
TOKENS = torch.randint(0, 96, (64,), generator=torch.Generator().manual_seed(2)).tolist()
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
KIND_OF = {"int8": Int8Linear, "q8_0": QBlockLinear}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_maker(tmp_path_factory)


def _engine(loaded, weights: str) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory=4 << 20, block_size=16, max_num_seqs=4, weights=weights), loaded)


def _dequantized_twin(loaded, quantized_model):
    """The fp32 model with the quantized model's weights as the values they compute with (no re-run of load-time
    transforms such as RWKV's rescaling)."""
    twin = copy.deepcopy(loaded)
    head = twin.model.head if hasattr(twin.model, "head") else twin.model.lm_head
    head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)  # untied: int8 keeps an
    twin.model.load_state_dict(quantized_model.state_dict())  # fp32 embedding beside the int8 head
    return twin


@pytest.mark.parametrize("weights", ["int8", "q8_0"])
@pytest.mark.parametrize("kind", KINDS)
def test_quantized_weights_compute_as_their_dequantized_fp32_twin(kind, weights, tiny, monkeypatch):
    directory, _ = tiny(kind)
    loaded = load_model(str(directory))
    engine = _engine(loaded, weights)
    assert engine.weights_mode == weights
    head = engine.loaded.model.head if kind == "rwkv" else engine.loaded.model.lm_head
    assert isinstance(head, KIND_OF[weights])
    linears = [m for m in engine.loaded.model.modules() if isinstance(m, KIND_OF[weights])]
    assert len(linears) >= 3 * engine.model_config.num_layers // 2, len(linears)
    twin = _engine(_dequantized_twin(loaded, engine.loaded.model), "fp32")
    fp32 = _engine(loaded, "fp32")
    with monkeypatch.context() as m:  # routed experts see few rows even in a whole-prompt step
        m.setattr(qblocks, "COMPILED_ROWS", 0)
        ours, ref = (position_logits(e, TOKENS, chunk_size=len(TOKENS)) for e in (engine, twin))
    assert (ref - position_logits(fp32, TOKENS, chunk_size=len(TOKENS))).abs().max() > 1e-3  # quantization shows
    # a whole-prompt step: fp32 activations times the dequantized weights
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    # one row a step: activations rounded to int8 per block (the operators' few-row path), close to the twin
    steps, ref_steps = (position_logits(e, TOKENS[:24], chunk_size=1) for e in (engine, twin))
    err = ((steps - ref_steps).norm() / ref_steps.norm()).item()
    assert err < 0.15, err  # 0.02-0.09 on these tiny random models (a missing bias or stale state: ~1)
    prompts = [TOKENS[:40], TOKENS[10:27]]  # greedy: the first token comes from the whole-prompt step
    got = [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, GREEDY)]
    want = [o.outputs[0].token_ids for o in LLM.from_engine(twin).generate(prompts, GREEDY)]
    assert [g[0] for g in got] == [w[0] for w in want], (got, want)
    assert engine.kv.state_pool.num_used == 0


@pytest.mark.parametrize("kind", ["granite-hybrid", "rwkv"])
def test_auto_on_a_directory_is_fp32(kind, tiny):
    directory, _ = tiny(kind)
    loaded = load_model(str(directory))
    auto, fp32 = _engine(loaded, "auto"), _engine(loaded, "fp32")
    assert auto.weights_mode == "fp32"
    assert torch.equal(position_logits(auto, TOKENS, chunk_size=7), position_logits(fp32, TOKENS, chunk_size=7))
