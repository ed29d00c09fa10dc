"""kvforge chat: a conversation in the terminal, answers streamed as they are generated.

Line editing and history (arrow keys, Ctrl-R) come from readline. Ctrl-C stops the answer being
generated (or clears the line being typed) and keeps the conversation; Ctrl-D or /exit quits.
Commands: /help, /exit, /clear, /system TEXT, /save FILE.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from kvforge.cli.common import add_engine_options, engine_kwargs
from kvforge.cli.sampling import add_sampling_options, cli_defaults, describe, sampling_params
from kvforge.cli.signals import sigint_seen, sigint_to_main_thread, start_sigint_relay
from kvforge.cli.startup import add_chat_template_option, apply_chat_template, say_loading, startup_line, template_note
from kvforge.errors import ConfigError, KVForgeError

COMMANDS = {
    "/help": "show these commands",
    "/exit": "quit (also /quit, Ctrl-D)",
    "/clear": "forget the conversation (the system prompt stays)",
    "/system TEXT": "set the system prompt (empty TEXT removes it)",
    "/save FILE": "write the conversation to FILE as JSON (OpenAI messages)",
}
HISTORY_FILE = os.path.join(os.path.expanduser("~"), ".kvforge_history")


def register(sub) -> None:
    p = sub.add_parser("chat", help="chat in the terminal (streamed; /help lists commands)", description=__doc__)
    p.add_argument("--system", default=None, help="system prompt (default: none)")
    add_chat_template_option(p)
    add_sampling_options(p, None, "most tokens per answer (default: until the model stops, up to max-model-len)")
    add_engine_options(p)
    p.set_defaults(func=run)


class Conversation:
    def __init__(self, system: str | None):
        self.system = system or None
        self.turns: list[dict] = []

    @property
    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    def command(self, line: str) -> str | None:
        """Run a /command; returns what to print, or None to quit."""
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        if name in ("/exit", "/quit"):
            return None
        if name == "/clear":
            self.turns = []
            return "[conversation cleared]"
        if name == "/system":
            self.system = rest or None
            return f"[system prompt {'set' if rest else 'removed'}]"
        if name == "/save":
            if not rest:
                return "[usage: /save FILE]"
            try:
                with open(rest, "w", encoding="utf-8") as f:
                    json.dump(self.messages, f, indent=2, ensure_ascii=False)
            except OSError as e:
                return f"[cannot write {rest}: {e.strerror}]"
            return f"[saved {len(self.messages)} messages to {rest}]"
        head = "" if name == "/help" else f"[unknown command {name}]\n"
        return head + "\n".join(f"  {c:<14} {h}" for c, h in COMMANDS.items())


def _interrupt(signum, frame):
    sigint_seen()
    raise KeyboardInterrupt


def read_line(interactive: bool) -> str | None:
    """One line of input; None at end of input (Ctrl-D). Ctrl-C while typing gives an empty line."""
    if not interactive:
        line = sys.stdin.readline()
        return line.rstrip("\n") if line else None
    try:
        return input("you> ")
    except EOFError:
        print()
        return None
    except KeyboardInterrupt:
        print()
        return ""


def _enable_readline() -> None:
    try:
        import readline
    except ImportError:  # no readline on this platform: plain input() still works
        return
    try:
        readline.read_history_file(HISTORY_FILE)
    except OSError:
        pass
    import atexit

    atexit.register(_save_history, readline)


def _save_history(readline) -> None:
    try:
        readline.write_history_file(HISTORY_FILE)
    except OSError:
        pass


def run(args: argparse.Namespace) -> int:
    from kvforge import LLM
    from kvforge.cli.streaming import stream_request

    if args.max_tokens is not None and args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    sampling_params(args, 1)  # bad sampling flags fail before the model loads
    say_loading(args.model)
    llm = LLM(**engine_kwargs(args))  # Ctrl-C while it loads: kvforge.cli.main prints one line, exit 130
    with sigint_to_main_thread():  # the relay thread must never take Ctrl-C itself
        if sys.stdin.isatty():
            start_sigint_relay()
            signal.signal(signal.SIGINT, _interrupt)
    tok = llm.get_tokenizer()
    apply_chat_template(tok, args.chat_template, llm.engine.model_config.eos_token_ids)
    if tok is None or not tok.chat_template:
        raise ConfigError("this model has no chat template (a base model); give one with --chat-template, or use "
                          "kvforge generate --raw for plain completion")
    defaults = cli_defaults(llm)
    interactive = sys.stdin.isatty()
    print(startup_line(llm, template_note(tok), describe(args, defaults)), file=sys.stderr, flush=True)
    if interactive:
        _enable_readline()
        print(f"kvforge chat with {os.path.basename(llm.engine.loaded.path)}; /help for commands, Ctrl-D or /exit "
              "quits, Ctrl-C stops an answer", file=sys.stderr)
    chat = Conversation(args.system)
    while True:
        line = read_line(interactive)
        if line is None:
            return 0
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            said = chat.command(line)
            if said is None:
                return 0
            print(said, flush=True)
            continue
        chat.turns.append({"role": "user", "content": line})
        try:
            ids = llm.render_chat(chat.messages)
            room = llm.engine.max_model_len - len(ids)
            params = sampling_params(args, min(args.max_tokens or room, max(room, 1)), defaults=defaults)
            if interactive:
                print("assistant> ", end="", flush=True)
            answer = stream_request(llm.engine, ids, params)
        except KVForgeError as e:  # e.g. the conversation outgrew max_model_len: keep the session
            chat.turns.pop()
            print(f"\n[error: {e}; /clear starts over]", flush=True)
            continue
        print(" [stopped]" if answer.interrupted else _cut_note(answer, args), flush=True)
        chat.turns.append({"role": "assistant", "content": answer.text})


def _cut_note(answer, args: argparse.Namespace) -> str:
    """An answer that ran out of tokens says so: ' [cut at --max-tokens N]' (or at max_model_len)."""
    output = answer.output
    if output is None or output.finish_reason != "length":
        return ""
    if args.max_tokens is not None and len(output.token_ids) >= args.max_tokens:
        return f" [cut at --max-tokens {args.max_tokens}]"
    return " [cut: the conversation reached max_model_len; /clear starts over]"
