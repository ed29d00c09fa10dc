"""DeepSeek-V2/V3 (MLA + MoE) equal transformers on tiny random models; the latent cache shares
prefixes, stores int8, and costs exactly the formula."""
import dataclasses

import pytest
import torch
from hf_reference import hf_greedy
from tiny_models import MLA, tiny_maker

from kvforge import LLM, SamplingParams
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.scoring import position_logits
from kvforge.errors import ModelLoadError
from kvforge.kv.memory import bytes_per_block, bytes_per_token
from kvforge.models.deepseek import DeepseekForCausalLM
from kvforge.models.loader import load_model

KINDS = ["deepseek-v2", "deepseek-v3", "deepseek-v3-yarn"]
TOKENS = torch.randint(0, 96, (50,), generator=torch.Generator().manual_seed(1)).tolist()
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_maker(tmp_path_factory)


def _engine(directory, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory=1 << 20, block_size=4, **options), load_model(str(directory)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_logits_match_transformers(kind, chunk, tiny):
    directory, hf = tiny(kind)
    engine = _engine(directory)
    assert engine.model_config.attention_kind == "MLA"
    ours = position_logits(engine, TOKENS, chunk_size=chunk)
    with torch.no_grad():
        ref = hf(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert engine.kv.allocator.num_used == engine.kv.prefix_tree.cached_blocks


@pytest.mark.parametrize("kind", ["deepseek-v2", "deepseek-v3"])
def test_greedy_generation_matches_transformers(kind, tiny):
    directory, hf = tiny(kind)
    llm = LLM(str(directory), kv_cache_memory=1 << 20, block_size=4, max_num_batched_tokens=16)
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 11, 29, 40)]
    outs = llm.generate(prompts, GREEDY)
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, p, 12)


def test_prefix_sharing_gives_the_same_tokens(tiny):
    directory, hf = tiny("deepseek-v3")
    prefix = TOKENS[:37]
    prompts = [prefix + [5, 6, 7], prefix + [9, 2]]
    results = {}
    for caching in (True, False):
        llm = LLM(str(directory), kv_cache_memory=1 << 20, block_size=4, enable_prefix_caching=caching)
        results[caching] = [llm.generate(p, GREEDY)[0].token_ids for p in prompts]  # one by one: the 2nd hits
        hits = llm.engine.kv.stats()["prefix_hit_tokens"]
        assert hits >= 36 if caching else hits == 0
    assert results[True] == results[False] == [hf_greedy(hf, p, 12) for p in prompts]


def test_int8_latents_stay_close_to_fp32(tiny):
    directory, _ = tiny("deepseek-v3")
    ref = position_logits(_engine(directory), TOKENS, chunk_size=7)
    int8 = _engine(directory, kv_cache_dtype="int8")
    ours = position_logits(int8, TOKENS, chunk_size=7)
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()
    llm = LLM(str(directory), kv_cache_memory=1 << 20, block_size=4, kv_cache_dtype="int8")
    assert len(llm.generate(TOKENS[:20], GREEDY)[0].token_ids) == 12


@pytest.mark.parametrize("fmt", ["fp32", "int8"])
def test_pool_bytes_equal_the_formula(fmt, tiny):
    directory, _ = tiny("deepseek-v2")
    engine = _engine(directory, kv_cache_dtype=fmt)
    latent = MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]
    assert (engine.kv_spec.num_kv_heads, engine.kv_spec.head_dim, engine.kv_spec.has_values) == (1, latent, False)
    pool = engine.kv.pool
    assert pool.allocated_bytes() == pool.num_blocks * bytes_per_block(engine.kv_spec, engine.format, 4)
    if fmt == "fp32":
        assert bytes_per_token(engine.kv_spec, engine.format, 4) == 1 * 2 * latent * 4


def test_unsupported_rope_scaling_is_a_load_error(tiny):
    cfg = load_model(str(tiny("deepseek-v2")[0])).config
    with pytest.raises(ModelLoadError, match="rope_scaling type 'dynamic'"):
        DeepseekForCausalLM(dataclasses.replace(cfg, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))


@pytest.mark.parametrize("kind", ["deepseek-v3", "deepseek-v3-yarn"])
def test_rerotate_moves_cached_rope_keys(kind, tiny):
    """A cached row rotated at p, re-rotated by s, equals the row rotated at p + s (KV compaction needs it)."""
    model = load_model(str(tiny(kind)[0])).model
    attn, rotary = model.model.layers[0].self_attn, model.rotary
    rows = torch.randn(6, 1, attn.kv_lora_rank + attn.rope_dim)
    pos, shift = torch.tensor([9, 10, 14, 20, 31, 40]), torch.tensor([-9, -3, -1, -5, -20, -2])

    def cached(p):
        cos, sin = rotary.cos_sin(p)
        return torch.cat((rows[..., : attn.kv_lora_rank], rotary.apply(rows[..., attn.kv_lora_rank :], cos, sin)), -1)

    torch.testing.assert_close(rotary.rerotate(cached(pos), shift), cached(pos + shift), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["deepseek-v2", "deepseek-v3"])
def test_projections_experts_and_lm_head_run_ops_linear_on_panels(kind, tiny, monkeypatch):
    """MLA's projections, every MLP's fused gate/up and down (dense, routed and shared experts) and the LM head get
    panel copies when the engine is built and run through ops `linear` (small_linear for a few rows, panel_linear
    for more), with transformers' tokens."""
    from kvforge.models.layers import GatedMLP
    from kvforge.ops import layers as ops_layers
    from kvforge.ops.panels import ATTRIBUTE

    directory, hf = tiny(kind)
    llm = LLM(str(directory), kv_cache_memory=1 << 20, block_size=4, max_num_batched_tokens=16)
    model = llm.engine.loaded.model
    mlps = [m for m in model.modules() if isinstance(m, GatedMLP)]
    assert len(mlps) > 8 and all(m.gate_up_weight is not None for m in mlps)
    declared = [w for m in model.modules() if hasattr(m, "linear_weights") for w in m.linear_weights()]
    assert len(declared) == len({id(w) for w in declared}) >= 2 * len(mlps) + 3 * len(model.model.layers) + 1
    assert all(hasattr(w, ATTRIBUTE) for w in declared)
    assert not any("gate_up" in name for name in model.state_dict())  # fused weights are buffers, not saved
    shapes = []
    real = ops_layers.linear
    monkeypatch.setattr(ops_layers, "linear", lambda x, w, b=None: shapes.append(x.shape[0]) or real(x, w, b))
    prompt = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    assert llm.generate([prompt], GREEDY)[0].token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)
    assert min(shapes) == 1 and max(shapes) == 16  # decode rows and 16-token prefill chunks
