"""What every `kvforge bench` subcommand shares: the model and output flags, and how a result is printed."""
from __future__ import annotations

import json
import sys

MODEL_HELP = "GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M)"


def output_options(p, model: bool = False) -> None:
    if model:
        p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def emit(result: dict, as_json: bool, rows: list[tuple[str, object]]) -> None:
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return
    for name, value in rows:
        if value is None:
            continue
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"{name:<42} {shown}")
