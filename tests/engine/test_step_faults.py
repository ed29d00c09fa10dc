"""A step whose model forward, sampler or post-processing raises fails only the requests in it (finish_reason
'error'); their half-written blocks never enter the prefix cache; the engine keeps serving, exactly."""
import pytest

import kvforge.engine.engine as engine_module
import kvforge.engine.runner as runner_module
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.models.loader import load_model
from kvforge.sampling_params import SamplingParams

A = list(range(3, 21))  # 18 tokens: 4 full blocks of 4 and 2 more
B = list(range(40, 50))
C = list(range(60, 75))
R = [5, 6, 7, 8] * 4 + [5]  # repeats itself: n-gram speculation drafts from it
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


class Boom(RuntimeError):
    pass


def make_engine(tiny_dir, **options) -> LLMEngine:
    config = {"kv_cache_memory": 1 << 22, "block_size": 4, "max_model_len": 128, **options}
    return LLMEngine(EngineConfig(**config), load_model(tiny_dir))


def finish(engine: LLMEngine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return finals


@pytest.fixture(scope="module")
def reference(tiny_dir) -> dict:
    engine = make_engine(tiny_dir)
    for rid, prompt in (("a", A), ("b", B), ("c", C), ("r", R)):
        engine.add_request(prompt, GREEDY, rid)
    return {rid: o.token_ids for rid, o in finish(engine).items()}


def assert_no_leak(engine: LLMEngine) -> None:
    engine.kv.reset_prefix_cache()
    assert engine.kv.allocator.num_used == 0


def test_sampler_fault_fails_its_batch_only_and_caches_none_of_its_blocks(tiny_dir, reference, monkeypatch):
    engine = make_engine(tiny_dir, max_num_seqs=1)  # one request per step: A's prefill runs alone
    engine.add_request(A, GREEDY, "a")
    engine.add_request(B, GREEDY, "b")

    def boom(*args):
        raise Boom("sampler broke")

    with monkeypatch.context() as m:
        m.setattr(runner_module, "sample", boom)
        outs = engine.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("a", True, "error")]
    assert outs[0].error == "Boom: sampler broke"
    assert finish(engine)["b"].token_ids == reference["b"]
    engine.add_request(A, GREEDY, "a-again")
    again = finish(engine)["a-again"]
    assert again.metrics.cached_tokens == 0  # the failed prefill computed 4 full blocks; none was shared
    assert again.token_ids == reference["a"]
    assert_no_leak(engine)


def test_forward_fault_mid_decode_keeps_blocks_of_earlier_steps(tiny_dir, reference):
    engine = make_engine(tiny_dir)
    engine.add_request(A, GREEDY, "a")
    engine.add_request(B, GREEDY, "b")
    for _ in range(3):
        assert all(o.finish_reason is None for o in engine.step())
    layers, calls = engine.kv.pool.layers, []
    healthy = layers[-1]

    class Broken:  # the last layer's cache fails on write, after the earlier layers wrote their K/V
        def __getattr__(self, name):
            return getattr(healthy, name)

        def plain_rows(self):
            return None  # not plain rows: the layer bridge calls the format's write too

        def write(self, *args):
            calls.append(1)
            raise Boom("the last layer broke after the earlier layers wrote their K/V")

    layers[-1] = Broken()
    outs = engine.step()
    layers[-1] = healthy
    assert calls and sorted((o.request_id, o.finish_reason) for o in outs) == [("a", "error"), ("b", "error")]
    assert not engine.has_unfinished_requests() and engine.requests == {}
    engine.add_request(A, GREEDY, "a-again")
    engine.add_request(C, GREEDY, "c")
    finals = finish(engine)
    assert finals["a-again"].metrics.cached_tokens == 16  # A's prompt blocks, cached by its good prefill step
    assert finals["a-again"].token_ids == reference["a"] and finals["c"].token_ids == reference["c"]
    assert_no_leak(engine)


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_postprocessing_fault_fails_that_request_only(tiny_dir, reference, monkeypatch, speculative):
    engine = make_engine(tiny_dir, speculative=speculative)
    engine.add_request(B, GREEDY, "b")
    engine.add_request(R, GREEDY, "r")
    check_stop = engine_module.check_stop
    drafts, batches = [], []
    execute = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", lambda batch: batches.append(batch) or execute(batch))

    def flaky(seq, *args):
        if seq.request_id == "b" and seq.num_output_tokens == 5:
            drafts.append(len(batches[-1].drafts(seq)))
            raise Boom("detokenizer broke")
        return check_stop(seq, *args)

    monkeypatch.setattr(engine_module, "check_stop", flaky)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert drafts == ([0] if speculative is None else [1])  # with speculation, the failing step verified a draft
    failed = [o for o in outs if o.finish_reason == "error"]
    assert [(o.request_id, o.token_ids[:5], o.error) for o in failed] == [("b", reference["b"][:5], "Boom: detokenizer broke")]
    assert [o.token_ids for o in outs if o.request_id == "r" and o.finished] == [reference["r"]]
    monkeypatch.setattr(engine_module, "check_stop", check_stop)
    engine.add_request(B, GREEDY, "b-again")  # what the failed step left in the prefix cache is right
    again = finish(engine)["b-again"]
    assert again.token_ids == reference["b"] and again.metrics.cached_tokens == 8  # B's 2 full prompt blocks
    assert_no_leak(engine)
