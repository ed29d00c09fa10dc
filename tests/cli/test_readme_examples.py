"""The README's examples run as written (so they cannot drift): the chat transcript is what a terminal shows, the
`kvforge generate` lines and the Python block run on the embedded model, and the default sampling answers the
transcript's question correctly in most runs."""
from __future__ import annotations

import io
import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest
from pty_session import PtySession
from reuse_model import reuse_loaded_smollm2  # noqa: F401  (autouse fixture)

from kvforge.cli import main

pytestmark = pytest.mark.slow
README = (Path(__file__).parents[2] / "README.md").read_text()
CHEAP = ["--max-tokens", "6", "--kv-memory", "64MiB"]  # appended: the last flag wins, so each example stays cheap


def blocks(language: str) -> list[str]:
    """The README's fenced blocks of one language ("" for plain ones), in order."""
    found, current, kind = [], None, None
    for line in README.splitlines():
        if line.startswith("```"):
            if current is None:
                current, kind = [], line[3:].strip()
            else:
                if kind == language:
                    found.append("\n".join(current) + "\n")
                current = None
        elif current is not None:
            current.append(line)
    return found


def transcript() -> list[str]:
    return next(b for b in blocks("") if b.startswith("$ kvforge chat")).splitlines()


def test_chat_transcript_is_what_a_terminal_shows(tmp_path):
    lines = transcript()
    command = shlex.split(lines[0].removeprefix("$ "))[1:]
    said = [line.removeprefix("you> ") for line in lines if line.startswith("you> ")]
    env = {**os.environ, "HOME": str(tmp_path), "TERM": "xterm", "OMP_NUM_THREADS": "1"}
    s = PtySession([sys.executable, "-m", "kvforge.cli", *command, "--seed", "0", "--kv-memory", "512MiB"], env)
    try:
        for text in said:
            s.expect("you> ")
            s.send(text + "\r")
        assert s.wait() == 0
    finally:
        s.kill()
    shown = [line.rstrip() for line in s.output.replace("\r\n", "\n").splitlines() if line.strip()]
    assert [_sizes_blanked(line) for line in shown] == [_sizes_blanked(line) for line in lines[1:]], "\n".join(shown)


def _sizes_blanked(line: str) -> str:
    """The KV budget line's sizes follow free memory (the README's) or --kv-memory (the test's): compare the rest."""
    return re.sub(r"\d[\d,.]*", "N", line) if line.startswith("[kv cache] KV budget") else line


def examples() -> list[str]:
    found = []
    for block in blocks("bash"):
        for line in block.splitlines():
            command = line.split("  #")[0].strip()
            if "kvforge generate" in command and "--help" not in command and "gemma" not in command:
                found.append(command)
    return found


@pytest.mark.parametrize("command", examples())
def test_generate_examples_run(command, smol_loaded, capsys, monkeypatch):
    stdin, _, command = command.rpartition("|")
    if stdin:
        monkeypatch.setattr(sys, "stdin", io.StringIO(shlex.split(stdin)[1]))
    rc = main(shlex.split(command)[1:] + CHEAP)
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.strip() and "[kvforge] SmolLM2-135M-Instruct.Q4_1.gguf" in err
    if "--json" in command:
        assert json.loads(out)["stats"]["generated_tokens"] >= 1


def test_python_example_runs(smol_loaded, capsys):
    code = next(b for b in blocks("python") if "from kvforge import LLM" in b)
    exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - the README's own code, run as a reader would
    printed = capsys.readouterr().out.splitlines()
    assert "Paris" in printed[0] and printed[-1].startswith("{") and "Logprob(logprob=" in printed[-1]


def test_default_sampling_answers_the_capital_of_france(smol_loaded):
    """Measured: 4 of seeds 0..4 answer Paris (15 of seeds 0..19) at the model's recommended temperature 0.2, top_p
    0.9; at the old default (temperature 1.0) it was 0 of 5 in the issue's runs."""
    from kvforge.config import EngineConfig
    from kvforge.engine.engine import LLMEngine
    from kvforge.llm import LLM

    llm = LLM.from_engine(LLMEngine(EngineConfig(kv_cache_memory=64 << 20, max_model_len=1024), smol_loaded))
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answers = [o.text for o in llm.chat([question] * 5, [{"seed": seed, "max_tokens": 12} for seed in range(5)])]
    assert sum("Paris" in a for a in answers) >= 4, answers


def test_disk_tier_example_hits_on_its_second_run(smol_loaded, capsys, tmp_path):
    """What the README says the disk tier example shows: blocks stored by the first run, read back by the second."""
    command = next(c for c in examples() if "--kv-tier disk:" in c)
    argv = [w.replace("/tmp/kvforge-kv", str(tmp_path / "kv")) for w in shlex.split(command)[1:]]
    stats = []
    for _ in range(2):
        assert main(argv + CHEAP) == 0
        stats.append(json.loads(capsys.readouterr().out)["stats"])
    stored = int(re.search(r'"tier_disk_stored_blocks": (\d+)', README).group(1))
    hits = int(re.search(r'"tier_disk_hit_tokens": (\d+)', README).group(1))
    assert stats[0]["tier_disk_stored_blocks"] == stored and stats[0]["tier_disk_hit_tokens"] == 0
    assert stats[1]["tier_disk_hit_tokens"] == stats[1]["tier_hit_tokens"] == hits == 16 * stored
    assert len(list((tmp_path / "kv").glob("*.kvb"))) == stored
