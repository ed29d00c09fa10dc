"""`kvforge generate` as a user runs it: chat template by default, --raw, prompt sources, --stop, --system, -n."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from reuse_model import reuse_loaded_smollm2  # noqa: F401  (autouse fixture)

from kvforge.cli import main
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.llm import LLM
from kvforge.sampling_params import SamplingParams
from kvforge.version import package_version

ENGINE = ["--kv-memory", "64MiB", "--max-model-len", "1024"]
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def offline(smol_loaded) -> LLM:
    return LLM.from_engine(LLMEngine(EngineConfig(kv_cache_memory=64 << 20, max_model_len=1024), smol_loaded))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["generate", *argv, *ENGINE])
    out, err = capsys.readouterr()
    return rc, out, err


def greedy(n: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, **kw)


def test_chat_template_by_default_and_raw_opts_out(capsys, offline, smol_loaded):
    rc, out, err = run_cli(capsys, QUESTION, "--temperature", "0", "--max-tokens", "12")
    expected = offline.chat([{"role": "user", "content": QUESTION}], greedy())[0].text
    assert rc == 0 and expected.strip() and out == expected + "\n"  # streamed, then a newline
    assert "Paris" in out
    assert "[kv cache]" in err and "finish:" in err
    rc, raw, _ = run_cli(capsys, QUESTION, "--raw", "--temperature", "0", "--max-tokens", "12")
    assert raw == offline.generate(QUESTION, greedy())[0].text + "\n"
    assert raw != out


def test_prompt_from_stdin_file_and_option_agree(capsys, offline, smol_loaded, tmp_path, monkeypatch):
    expected = offline.chat([{"role": "user", "content": QUESTION}], greedy(6))[0].text + "\n"
    path = tmp_path / "prompt.txt"
    path.write_text(QUESTION)
    assert run_cli(capsys, "--prompt-file", str(path), "--temperature", "0", "--max-tokens", "6")[1] == expected
    monkeypatch.setattr(sys, "stdin", io.StringIO(QUESTION))
    assert run_cli(capsys, "--temperature", "0", "--max-tokens", "6", "--no-stream")[1] == expected
    assert run_cli(capsys, "-p", QUESTION, "x", "--max-tokens", "6")[0] == 2  # two prompts: refused


def test_system_stop_and_n_samples(capsys, offline, smol_loaded):
    system = "You answer in French."
    _, out, _ = run_cli(capsys, QUESTION, "--system", system, "--temperature", "0", "--max-tokens", "12", "--json")
    expected = offline.chat([{"role": "system", "content": system}, {"role": "user", "content": QUESTION}], greedy())
    assert json.loads(out)["text"] == expected[0].text
    full = offline.chat([{"role": "user", "content": QUESTION}], greedy())[0].text
    stop = full.split()[2]  # a word in the middle of the greedy answer
    _, out, _ = run_cli(capsys, QUESTION, "--stop", stop, "--temperature", "0", "--max-tokens", "12")
    assert out == full[: full.index(stop)] + "\n"
    _, out, _ = run_cli(capsys, "Once upon a time", "--raw", "-n", "3", "--seed", "5", "--max-tokens", "8", "--json",
                        "--temperature", "1")
    body = json.loads(out)
    samples = [s["text"] for s in body["samples"]]
    again = offline.generate("Once upon a time", {"n": 3, "seed": 5, "max_tokens": 8, "temperature": 1.0})[0].outputs
    assert samples == [o.text for o in again] and len(set(samples)) > 1
    assert body["stats"]["generated_tokens"] == sum(len(s["token_ids"]) for s in body["samples"])
    assert body["stats"]["kvforge_version"] == package_version()


def test_unseeded_runs_differ():
    """Two real processes: the default (unseeded) sampling is fresh in each run."""
    argv = [sys.executable, "-m", "kvforge.cli", "generate", "--raw", "Once upon a time", "--max-tokens", "16",
            "--temperature", "1.0", "--no-stream", *ENGINE]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [subprocess.Popen(argv + extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for extra in ([], [])]
    outs = []
    for p in runs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        outs.append(out)
    assert outs[0] != outs[1]


def test_seeded_cli_run_repeats_the_python_api(capsys, offline, smol_loaded):
    out = run_cli(capsys, "Once upon a time", "--raw", "--seed", "3", "--max-tokens", "16", "--no-stream")[1]
    defaults = offline.get_default_sampling_params()  # the model's recommended sampling, as the CLI's default
    assert (defaults.temperature, defaults.top_p) == (0.2, 0.9)
    want = SamplingParams(max_tokens=16, seed=3, temperature=defaults.temperature, top_p=defaults.top_p)
    assert out == offline.generate("Once upon a time", want)[0].text + "\n"
