"""kvforge: a KV-cache-centred LLM inference engine, and the lab that measures KV techniques.

Start with `kvforge chat` (the embedded SmolLM2-135M-Instruct; no download) or
`kvforge generate "Why is the sky blue?"`. Every command takes --help.

Sampling defaults are the OpenAI API's (as vLLM's), the same in the CLI, Python (SamplingParams) and the
server: temperature 1.0, top_p 1.0, top_k off, no penalties, no seed (fresh randomness every run; --seed N
reproduces). Pass --temperature 0 for greedy output.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from kvforge.cli.formatting import VersionAction, apply_formatter
from kvforge.cli.signals import sigint_to_main_thread
from kvforge.errors import KVForgeError

SUBCOMMANDS = ["chat", "generate", "serve", "memory", "advise", "eval", "bench", "lab", "calibrate"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvforge", description=__doc__)
    parser.add_argument("--version", action=VersionAction, help="print the version (from git in a checkout) and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"kvforge.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"kvforge.cli.{name}":
                raise
            continue
        module.register(sub)
    apply_formatter(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        with sigint_to_main_thread():  # the threads torch starts at import never take Ctrl-C
            parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:  # bare `kvforge`
            parser.print_help()
            return 0
        return args.func(args) or 0
    except KeyboardInterrupt:  # Ctrl-C anywhere outside an answer being written (model load, start-up): one line
        print(("\n" if sys.stderr.isatty() else "") + "kvforge: interrupted", file=sys.stderr)  # after the ^C echo
        return 130
    except KVForgeError as e:
        print(f"kvforge: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        sys.stderr.close()
        return 0
