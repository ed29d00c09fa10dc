"""`kvforge` command line: one module per subcommand, each with `register(subparsers)`."""
from __future__ import annotations

import argparse
import importlib
import sys

from kvforge.errors import KVForgeError

SUBCOMMANDS = ["generate", "chat", "serve", "bench", "eval", "memory", "advise", "lab"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvforge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"kvforge.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"kvforge.cli.{name}":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KVForgeError as e:
        print(f"kvforge: error: {e}", file=sys.stderr)
        return 2
