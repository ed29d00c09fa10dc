"""Swap preemption on recurrent models: a preempted sequence's state slot goes to the host tier with its blocks and
comes back exactly, so a sequence swapped out mid-prefill or mid-decode (while another request reuses its slot)
gives the tokens of a run without preemption and of transformers; no state slot, block or swapped entry is left.
A state the tier could not keep makes the request recompute, with the same tokens."""
import pytest
import torch
from hf_reference import hf_greedy_recomputed
from tiny_models import write_tiny_model

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.scheduler import ScheduledBatch
from kvforge.kv.formats import get_format
from kvforge.kv.groups import build_groups, state_bytes_per_sequence
from kvforge.kv.memory import pool_bytes
from kvforge.models.loader import load_model
from kvforge.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPT = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(3)).tolist()
OTHER = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(4)).tolist()


@pytest.fixture(scope="module", params=["granite-hybrid", "mamba2"])
def model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf = write_tiny_model(request.param, d)
    return load_model(str(d)), hf


def _engine(loaded, tier="host:16MiB", **options) -> LLMEngine:
    # one state slot: the request run while the first is swapped out takes (and overwrites) its slot
    return LLMEngine(EngineConfig(kv_cache_memory=4 << 20, max_num_seqs=1, max_num_batched_tokens=16, block_size=16,
                                  kv_tiers=[tier], preemption_mode="swap", **options), loaded)


def _finish(engine, rid) -> list[int]:
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.request_id == rid and o.finished), out)
    return out.token_ids


def _swapped_run(engine, when) -> list[int]:
    """PROMPT's greedy tokens, swapped out once `when(seq)` holds, with OTHER run to the end before it comes back."""
    rid = engine.add_request(PROMPT, GREEDY)
    seq = engine.requests[rid]
    while not when(seq):
        engine.step()
    engine.scheduler.running.remove(seq)
    engine.scheduler._preempt(seq, ScheduledBatch())
    engine.scheduler.waiting.remove(seq)
    assert engine.kv.state_pool.num_free == 1  # its slot went back with its blocks
    _finish(engine, engine.add_request(OTHER, GREEDY))
    engine.scheduler.waiting.append(seq)
    return _finish(engine, rid)


def _assert_nothing_left(engine) -> None:
    s = engine.stats()
    assert s["swapped_requests"] == 0 and s["state_slots_used"] == 0
    assert engine.kv.state_pool.num_free == engine.kv.state_pool.num_slots
    tree = engine.kv.prefix_tree
    assert engine.kv.allocator.num_free + (tree.cached_blocks if tree is not None else 0) == engine.kv.num_blocks


MID_PREFILL = {"mid-prefill": lambda seq: seq.num_computed_tokens == 32,  # 8 prompt tokens left
               "mid-decode": lambda seq: len(seq.output_token_ids) == 4}


@pytest.mark.parametrize("when", MID_PREFILL.values(), ids=MID_PREFILL.keys())
def test_swapped_state_comes_back_exactly(model, when):
    loaded, hf = model
    want = hf_greedy_recomputed(hf, PROMPT, 10)
    engine = _engine(loaded)
    assert _swapped_run(engine, when) == want
    s = engine.stats()
    assert s["preemptions"] == 1 and s["preempted_tokens_recomputed"] == 0 and s["swap_failures"] == 0
    assert s["swapped_in_blocks"] == s["swapped_out_blocks"]
    _assert_nothing_left(engine)
    engine.tiers.flush()
    assert engine.tiers.tiers[0].used_bytes() == 0  # the swapped blocks and state were discarded


def test_a_lost_state_recomputes(model):
    loaded, hf = model
    engine = _engine(loaded, tier="host:1KiB")  # too small for the state: the swap-in fails
    assert _swapped_run(engine, MID_PREFILL["mid-decode"]) == hf_greedy_recomputed(hf, PROMPT, 10)
    assert engine.stats()["swap_failures"] == 1
    _assert_nothing_left(engine)


def _tight(loaded, blocks: int, **options) -> LLMEngine:
    """Four state slots and `blocks` KV blocks of 16 tokens: the scheduler preempts when the sequences grow."""
    cfg = loaded.config
    state = state_bytes_per_sequence(cfg.state_groups)
    memory = pool_bytes(cfg.kv_cache_spec(), get_format("fp32"), 16, blocks, 4, build_groups(cfg.layer_windows()), state)
    return LLMEngine(EngineConfig(kv_cache_memory=memory, max_num_seqs=4, max_num_batched_tokens=32, block_size=16,
                                  max_model_len=128, enable_prefix_caching=False, **options), loaded)


def test_scheduler_swaps_a_hybrid_under_a_tight_budget(model):
    loaded, _ = model
    if not loaded.config.kv_cache_spec().num_layers:
        pytest.skip("blocks of a model without attention layers cost nothing: it never runs out of them")
    prompts = [PROMPT[i:] + OTHER[:i] for i in range(0, 24, 6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def run(engine):
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        return [done[i] for i in ids]

    engine = _tight(loaded, 14, kv_tiers=["host:16MiB"], preemption_mode="swap")
    assert run(engine) == run(_tight(loaded, 64))
    s = engine.stats()
    assert s["preemptions"] > 0 and s["preempted_tokens_recomputed"] == 0 and s["swap_failures"] == 0
    _assert_nothing_left(engine)


def test_abort_while_swapped_or_swapping_in_leaves_nothing(model):
    loaded, _ = model
    engine = _engine(loaded)
    rid = engine.add_request(PROMPT, GREEDY)
    seq = engine.requests[rid]
    engine.step()
    engine.scheduler.running.remove(seq)
    engine.scheduler._preempt(seq, ScheduledBatch())
    assert engine.abort(rid)  # while swapped out
    rid = engine.add_request(PROMPT, GREEDY)
    seq = engine.requests[rid]
    engine.step()
    engine.scheduler.running.remove(seq)
    engine.scheduler._preempt(seq, ScheduledBatch())
    engine.kv.match_prefix(seq)  # the swap-in starts: a slot and blocks are reserved for it
    assert engine.kv.is_loading(seq) and engine.kv.state_pool.num_free == 0
    assert engine.abort(rid)
    _assert_nothing_left(engine)
    engine.tiers.flush()
    assert engine.tiers.tiers[0].used_bytes() == 0
