"""Greedy output token-for-token identical to transformers on the real SmolLM2 (same GGUF, fp32)."""
import pytest
from hf_reference import hf_greedy

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
NEW_TOKENS = 32

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three colours:",
    "The KV cache stores the keys and values of every past token so that each decoding step",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    ("To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer "
    "The slings and arrows of outrageous fortune, Or to take arms against a sea of troubles"),
    "Water",
    ("The GNU General Public License is a free, copyleft license for software and other kinds of works. "
    "The licenses for most software and other practical works are designed to take away your freedom to "
    "share and change the works. By contrast, the GNU General Public License is intended to guarantee your "
    "freedom to share and change all versions of a program--to make sure it remains free software for all "
    "its users. We, the Free Software Foundation, use the GNU General Public License for most of our software;"),
    "In mathematics, a prime number is",
]


@pytest.fixture(scope="module")
def prompt_ids(smol_loaded):
    return [smol_loaded.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(hf_smol, prompt_ids):
    return [hf_greedy(hf_smol, ids, NEW_TOKENS) for ids in prompt_ids]


def run_batch(loaded, prompt_ids, **options):
    engine = LLMEngine(EngineConfig(**options), loaded)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompt_ids]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [done[i] for i in ids], engine


def test_batch_matches_transformers(smol_loaded, prompt_ids, reference):
    assert len({len(p) for p in prompt_ids}) >= 8, "the batch mixes prompt lengths"
    outs, engine = run_batch(smol_loaded, prompt_ids, kv_cache_memory=64 << 20)
    assert outs == reference
    assert engine.kv.allocator.num_used == engine.kv.prefix_tree.cached_blocks


def test_under_preemption_matches_transformers(smol_loaded, prompt_ids, reference):
    # 20 blocks of 16 tokens: far less than the batch needs, so sequences are preempted and recomputed
    outs, engine = run_batch(smol_loaded, prompt_ids, kv_cache_memory=20 * 16 * 46080, max_model_len=320,
                             enable_prefix_caching=False)
    assert engine.kv.num_blocks == 20
    assert engine.scheduler.num_preemptions > 0
    assert outs == reference
    assert engine.kv.allocator.num_free == engine.kv.num_blocks


def test_small_prefill_chunks_match_transformers(smol_loaded, prompt_ids, reference):
    outs, _engine = run_batch(smol_loaded, prompt_ids, kv_cache_memory=64 << 20, max_num_batched_tokens=7,
                             max_model_len=1024)
    assert outs == reference
