"""`kvforge chat` at a real terminal (a pseudo-terminal): Ctrl-C, readline editing and history, commands, Ctrl-D."""
from __future__ import annotations

import json
import os
import sys

from pty_session import PtySession

CHAT = [sys.executable, "-m", "kvforge.cli", "chat", "--temperature", "0", "--kv-memory", "128MiB",
        "--max-model-len", "2048", "--system", "You are helpful."]


def test_chat_session_survives_ctrl_c_and_keeps_history(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "TERM": "xterm", "OMP_NUM_THREADS": "1"}
    s = PtySession(CHAT + ["--ignore-eos", "--max-tokens", "4000"], env)
    try:
        s.expect("you> ")
        s.send("Count from one to a thousand in words.\r")
        s.expect("assistant> ")
        s.expect(r"\w+ \w+")
        s.send("\x03")  # Ctrl-C while generating: the answer stops, the session stays
        assert "[stopped]" in s.expect("you> ")
        s.send("\x03")  # Ctrl-C at an empty prompt: a fresh prompt at once, the session stays
        s.expect("you> ", timeout=10)
        s.send("/system Be brief.\r")
        assert "[system prompt set]" in s.expect("you> ")
        s.send("helo\x1b[D\x1b[Dl\r")  # typed "helo", two left arrows, "l": readline edits it to "hello"
        s.expect("assistant> ")
        s.expect(r"\w")
        s.send("\x03")
        s.expect("you> ")
        s.send(f"/save {tmp_path}/conversation.json\r")
        assert "saved 5 messages" in s.expect("you> ")
        s.send("\x1b[A\r")  # up arrow: history recalls the /save line
        assert "saved 5 messages" in s.expect("you> ")
        s.send("/clear\r")
        assert "[conversation cleared]" in s.expect("you> ")
        s.send(f"/save {tmp_path}/cleared.json\r")
        s.expect("saved 1 messages")
        s.send("\x04")  # Ctrl-D quits cleanly
        assert s.wait() == 0
    finally:
        s.kill()
    assert "Traceback" not in s.output
    saved = json.loads((tmp_path / "conversation.json").read_text())
    assert [m["role"] for m in saved] == ["system", "user", "assistant", "user", "assistant"]
    assert saved[0]["content"] == "Be brief."
    assert saved[3]["content"] == "hello"
    shown = s.output.replace("^C", "")
    assert saved[2]["content"].strip() and saved[2]["content"] in shown, repr(s.output[:400])  # the interrupted answer
    assert json.loads((tmp_path / "cleared.json").read_text()) == [{"role": "system", "content": "Be brief."}]
    assert "hello" in (tmp_path / ".kvforge_history").read_text()


def test_chat_exit_command_and_piped_input(tmp_path):
    """Without a terminal, chat reads one message per line; empty lines are skipped and /exit quits."""
    import subprocess

    env = {**os.environ, "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(CHAT + ["--max-tokens", "8"], input="\nWhat is 2+2?\n/frobnicate\n/exit\nnot read\n", text=True,
                       capture_output=True, env=env, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    answer, _, commands = r.stdout.partition("[unknown command /frobnicate]\n")
    assert answer.strip()  # the answer, then the unknown command's help, and "not read" was never sent
    help_lines = commands.splitlines()
    assert len(help_lines) == 5 and help_lines[0].split()[0] == "/help"


def test_ctrl_c_while_the_model_loads_prints_one_line_and_exits_130(tmp_path):
    """chat, generate and serve: Ctrl-C during start-up is one line on the terminal and exit code 130."""
    env = {**os.environ, "HOME": str(tmp_path), "TERM": "xterm", "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "kvforge.cli"]
    for argv in (base + ["chat"], base + ["generate", "Hi", "--max-tokens", "4"], base + ["serve", "--port", "0"]):
        s = PtySession(argv + ["--kv-memory", "64MiB"], env)
        try:
            s.expect("loading")
            s.send("\x03")
            assert s.wait(timeout=60) == 130, s.output
        finally:
            s.kill()
        after = [line for line in s.output.split("loading", 1)[1].replace("^C", "").splitlines() if line.strip()]
        assert after[1:] == ["kvforge: interrupted"] and "Traceback" not in s.output, s.output


def test_chat_marks_an_answer_cut_by_max_tokens(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "TERM": "xterm", "OMP_NUM_THREADS": "1"}
    s = PtySession(CHAT + ["--max-tokens", "3"], env)
    try:
        s.expect("you> ")
        s.send("Tell me a long story about a dragon.\r")
        assert "[cut at --max-tokens 3]" in s.expect("you> ")
        s.send("\x04")
        assert s.wait() == 0
    finally:
        s.kill()
