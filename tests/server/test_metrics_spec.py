"""/metrics carries every speculative-decoding counter the engine keeps, with the engine's values."""
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.sampling_params import SamplingParams
from kvforge.server.metrics import ENGINE_GAUGES, ServerMetrics


def test_spec_counters_reach_metrics(tiny_loaded):
    e = LLMEngine(EngineConfig(block_size=8, max_model_len=128, kv_cache_memory=1 << 22,
                               speculative={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}),
                  tiny_loaded)
    for prompt in ([5, 6, 7, 8] * 5, list(range(20, 50))):
        e.add_request(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    while e.has_unfinished_requests():
        e.step()
    stats = e.stats()
    counters = sorted(k for k, v in stats.items() if k.startswith("spec_num_") and isinstance(v, int))
    exported = {key: name for key, name, _, _ in ENGINE_GAUGES}
    assert counters and set(counters) <= set(exported), set(counters) - set(exported)
    values = dict(line.rsplit(" ", 1) for line in ServerMetrics().render(stats).splitlines() if not line.startswith("#"))
    assert all(float(values[exported[k]]) == stats[k] for k in counters)
    assert stats["spec_num_drafts"] > 0
