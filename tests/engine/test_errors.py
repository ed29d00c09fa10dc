"""Bad input gets a clear typed error, and the engine keeps serving everyone else."""
import pytest

from kvforge import LLM, SamplingParams
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.scheduler import ScheduledBatch
from kvforge.errors import ConfigError, InvalidRequestError, ModelLoadError, PromptTooLongError
from kvforge.models.loader import load_model


@pytest.fixture
def engine(tiny_loaded):
    return LLMEngine(EngineConfig(kv_cache_memory=1 << 22, block_size=4, max_model_len=64), tiny_loaded)


def finish_all(engine):
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


@pytest.mark.parametrize("prompt, match", [
    ([], "empty"),
    ("", "empty"),
    ([1, 2, 10**6], r"\[0, 96\)"),
    ([1, -3], r"\[0, 96\)"),
    (3.5, "str or a list"),
])
def test_bad_prompts(engine, prompt, match):
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request(prompt, SamplingParams(max_tokens=2))


def test_prompt_longer_than_max_model_len(engine):
    with pytest.raises(PromptTooLongError, match="max_model_len is 64"):
        engine.add_request(list(range(1, 80)), SamplingParams(max_tokens=2))


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -7}, "top_k"),
    ({"temperature": float("nan")}, "temperature"),
    ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_engine_keeps_serving_after_errors(engine):
    ok = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    for bad in ([], list(range(1, 100))):
        with pytest.raises(InvalidRequestError):
            engine.add_request(bad, SamplingParams(max_tokens=2))
    engine.step()
    other = engine.add_request([8, 9], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    done = finish_all(engine)
    assert len(done[ok].token_ids) == 5 and len(done[other].token_ids) == 3
    assert engine.kv.allocator.num_used == engine.kv.prefix_tree.cached_blocks


def test_abort_frees_blocks_any_time(engine):
    ids = [engine.add_request(list(range(1, 30)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
           for _ in range(3)]
    assert engine.abort(ids[2])  # still waiting
    engine.step()
    assert engine.abort(ids[0])  # running
    assert not engine.abort("no-such-request")
    done = finish_all(engine)
    assert list(done) == [ids[1]]
    engine.kv.reset_prefix_cache()
    assert engine.kv.allocator.num_free == engine.kv.num_blocks


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM("/no/such/model.gguf")


def test_corrupt_safetensors(tmp_path, tiny_dir):
    import shutil

    shutil.copy(f"{tiny_dir}/config.json", tmp_path / "config.json")
    with open(f"{tiny_dir}/model.safetensors", "rb") as f:
        data = f.read()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_model(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path))


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("kwargs, match", [
    ({"block_size": 3}, "block_size"),
    ({"kv_layout": "ring"}, "kv_layout"),
    ({"kv_cache_dtype": "int3"}, "unknown kv_cache_dtype"),
    ({"kv_cache_memory": 1000, "max_model_len": 64}, "raise kv_cache_memory"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
])
def test_bad_engine_options(tiny_loaded, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LLMEngine(EngineConfig(**{"kv_cache_memory": 1 << 22, **kwargs}), tiny_loaded)


def test_without_chunked_prefill_a_prompt_longer_than_a_step_is_refused(tiny_loaded):
    engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 22, block_size=4, max_model_len=64,
                                    max_num_batched_tokens=64, enable_chunked_prefill=False), tiny_loaded)
    engine.config.max_num_batched_tokens = engine.scheduler.max_num_batched_tokens = 16  # a step smaller than the context
    with pytest.raises(PromptTooLongError, match="max_num_batched_tokens=16"):
        engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=2))
    ok = engine.add_request(list(range(1, 16)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert finish_all(engine)[ok].finish_reason == "length"


def test_without_chunked_prefill_a_recompute_longer_than_a_step_still_runs(tiny_loaded):
    """A preempted sequence that grew past one step's budget is recomputed in chunks instead of waiting forever."""
    engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 22, block_size=4, max_model_len=64, max_num_batched_tokens=64,
                                    enable_chunked_prefill=False, enable_prefix_caching=False), tiny_loaded)
    engine.scheduler.max_num_batched_tokens = 16
    rid = engine.add_request(list(range(1, 12)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(10):
        engine.step()
    seq = engine.requests[rid]
    engine.scheduler.running.remove(seq)
    engine.scheduler._preempt(seq, ScheduledBatch())  # now 21 tokens to recompute, step budget 16
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.kv.allocator.num_used == 0
