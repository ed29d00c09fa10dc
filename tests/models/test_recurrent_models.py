"""Granite 4.0-H hybrids (Mamba-2 mixers + attention) and pure Mamba-2 equal transformers on tiny random models,
whether a prompt runs in one step, in chunks or token by token, alone or batched with other requests; each running
sequence holds one state slot, given back on finish and abort."""
import pytest
import torch
from hf_reference import hf_greedy_recomputed as hf_greedy
from hf_reference import hf_stepwise_logits
from tiny_models import tiny_maker

from kvforge import LLM, SamplingParams
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.scoring import position_logits
from kvforge.errors import ConfigError
from kvforge.models.loader import load_model

KINDS = ["granite-hybrid", "granite-hybrid-nope", "mamba2", "mamba2-one-group", "lfm2", "rwkv", "qwen3-next"]
TOKENS = torch.randint(0, 96, (150,), generator=torch.Generator().manual_seed(1)).tolist()
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
BUDGET = 4 << 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_maker(tmp_path_factory)


def _engine(directory, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory=BUDGET, block_size=16, max_num_seqs=4, **options),
                     load_model(str(directory)))


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers_in_any_chunking(kind, tiny):
    directory, hf = tiny(kind)
    engine = _engine(directory)
    if kind == "qwen3-next":  # transformers' chunked delta rule (prefill) and its recurrent form (decode) differ by
        ref = hf_stepwise_logits(hf, TOKENS)  # 2e-4 here; the engine computes the recurrent form in every chunking
    else:
        with torch.no_grad():
            ref = hf(torch.tensor([TOKENS])).logits[0]
    assert ref.abs().max() > 1.0  # logits large enough that a 1e-4 tolerance means something
    for chunk in (len(TOKENS), 64, 7, 1):
        ours = position_logits(engine, TOKENS, chunk_size=chunk)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4, msg=f"chunks of {chunk}")
        assert engine.kv.state_pool.num_used == 0


@pytest.mark.parametrize("kind", ["granite-hybrid", "mamba2", "lfm2", "rwkv", "qwen3-next"])
def test_batched_chunked_greedy_matches_transformers(kind, tiny):
    """Prompts of several lengths run together, prefills cut into chunks of 16 tokens of a shared step budget."""
    directory, hf = tiny(kind)
    llm = LLM(str(directory), kv_cache_memory=BUDGET, max_num_seqs=4, max_num_batched_tokens=16)
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 11, 29, 40)]
    outs = llm.generate(prompts, GREEDY)
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, p, 10)
    assert llm.engine.kv.state_pool.num_used == 0


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_by_recompute_restores_the_state(tiny, caching):
    """A budget that holds two long sequences' KV but four state slots: sequences are preempted and recomputed
    (with prefix caching, resuming from their own state checkpoints)."""
    directory, hf = tiny("granite-hybrid")
    prompts = [torch.randint(0, 96, (60,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(4)]
    probe = _engine(directory)
    checkpoints = 8 * probe.state_bytes if caching else 0
    budget = checkpoints + 4 * probe.state_bytes + 14 * probe.kv.block_bytes  # four 100-token sequences need 28
    llm = LLM(str(directory), kv_cache_memory=budget, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32,
              enable_prefix_caching=caching, state_checkpoint_memory=checkpoints)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats["preemptions"] > 0
    assert stats.get("state_checkpoints_hit", 0) > 0 if caching else "state_checkpoints_hit" not in stats
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, p, 40)


def test_abort_during_prefill_gives_back_the_state_slot(tiny):
    directory, _ = tiny("granite-hybrid")
    engine = _engine(directory, max_num_batched_tokens=16)
    engine.add_request(TOKENS[100:108], GREEDY, request_id="b")
    engine.add_request(TOKENS[:100], GREEDY, request_id="a")
    engine.step()  # b's whole prompt and a's first 8 tokens
    assert engine.kv.state_pool.num_used == 2
    engine.abort("a")
    assert engine.kv.state_pool.num_used == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.state_pool.num_used == 0
    assert engine.kv.allocator.num_used == engine.kv.prefix_tree.cached_blocks


def test_state_bytes_are_the_formula(tiny):
    directory, _ = tiny("granite-hybrid")
    engine = _engine(directory)
    cfg = engine.model_config
    m = cfg.extra["mamba"]
    conv = (m["d_conv"] - 1) * (m["intermediate"] + 2 * m["n_groups"] * m["d_state"])
    per_layer = 4 * (conv + m["n_heads"] * m["head_dim"] * m["d_state"])
    assert engine.state_bytes == 3 * per_layer  # three mixer layers; the attention layer caches KV
    assert engine.kv.state_pool.allocated_bytes() == 4 * engine.state_bytes
    assert engine.kv_spec.num_layers == 1
    assert engine.kv.pool.allocated_bytes() + engine.kv.state_pool.allocated_bytes() <= BUDGET


def test_what_recurrent_layers_do_not_support_is_refused(tiny):
    directory, _ = tiny("mamba2")
    with pytest.raises(ConfigError, match="recurrent state of max_num_seqs"):
        LLMEngine(EngineConfig(kv_cache_memory=10_000, max_num_seqs=4), load_model(str(directory)))
