"""The public API and CLI on the real SmolLM2: text, chat, stop strings, JSON stats."""
import json
import subprocess
import sys

import pytest

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.llm import LLM
from kvforge.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(smol_loaded):
    return LLM.from_engine(LLMEngine(EngineConfig(kv_cache_memory=128 << 20, max_model_len=1024), smol_loaded))


def test_text_prompt_and_tokenizer_round_trip(llm):
    tok = llm.get_tokenizer()
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))[0]
    assert "Paris" in out.text
    assert tok.decode(out.token_ids) == out.text
    assert out.prompt_token_ids == tok.encode("The capital of France is")


def test_stop_string_cuts_text(llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate("Once upon a time", params)[0]
    word = full.text.split()[5]
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40, stop=[word]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(word)]
    assert len(out.token_ids) < 40


def test_chat_uses_template_and_stops_at_im_end(llm):
    out = llm.chat([{"role": "user", "content": "What is 2+2? Answer with a number."}],
                   SamplingParams(temperature=0, max_tokens=48))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2
    assert "4" in out.text and "<|im_end|>" not in out.text


def test_cli_generate_json():
    proc = subprocess.run([sys.executable, "-m", "kvforge.cli", "generate", "--prompt", "The capital of France is",
                           "--raw", "--temperature", "0", "--max-tokens", "6", "--kv-memory", "64MiB", "--json"], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert "Paris" in data["text"] and len(data["token_ids"]) <= 6
    s = data["stats"]
    assert s["kv_blocks_total"] == 64 * 2**20 // (16 * 46080)
    assert 0 < s["kv_blocks_used_peak"] <= s["kv_blocks_total"]
    assert s["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 4


def test_cli_reports_bad_input_cleanly():
    proc = subprocess.run([sys.executable, "-m", "kvforge.cli", "generate", "--prompt", "hi", "--max-tokens", "0"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2
    assert "max_tokens must be an integer >= 1" in proc.stderr and "Traceback" not in proc.stderr
