"""docs/results.md and README.md's "Measured" table, rendered from docs/results.json.

One entry per figure: technique, figure, value, the command that reproduces it, the machine it ran on and the
date. `python -m kvforge.bench.results_doc` rewrites both documents; `--check` exits 1 when either differs
from the rendering (tests/bench/test_results_doc.py checks the same, and that every command parses).
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from kvforge.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "results.json"
RESULTS_MD = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
README_BEGIN = "<!-- measured: generated from docs/results.json by `python -m kvforge.bench.results_doc` -->"
README_END = "<!-- /measured -->"
LAYOUTS = ("rows", "grid")
FIGURE_FIELDS = ("technique", "figure", "value", "command", "machine", "date")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}$")
GRID_PLACEHOLDER = "FORMAT"


@dataclass(frozen=True)
class Figure:
    technique: str
    figure: str
    value: str
    commands: tuple[str, ...]
    machine: str
    date: str
    id: str = ""


@dataclass(frozen=True)
class Section:
    title: str
    layout: str
    text: str
    figures: tuple[Figure, ...]


@dataclass(frozen=True)
class ReadmeRow:
    what: str
    figure: str
    sources: tuple[str, ...]


@dataclass(frozen=True)
class Results:
    intro: str
    machines: dict[str, str]
    sections: tuple[Section, ...]
    readme: tuple[ReadmeRow, ...]

    def figures(self) -> list[Figure]:
        return [f for s in self.sections for f in s.figures]

    def by_id(self) -> dict[str, Figure]:
        return {f.id: f for f in self.figures() if f.id}


def _figure(raw: dict, machines: dict[str, str], where: str) -> Figure:
    missing = [k for k in FIGURE_FIELDS if not raw.get(k)]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}; every figure needs {', '.join(FIGURE_FIELDS)}")
    unknown = set(raw) - set(FIGURE_FIELDS) - {"id"}
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {', '.join(FIGURE_FIELDS)}, id")
    if raw["machine"] not in machines:
        raise ConfigError(f"{where}: machine {raw['machine']!r} is not one of {sorted(machines)}")
    if not DATE.match(raw["date"]):
        raise ConfigError(f"{where}: date {raw['date']!r} is not YYYY-MM-DD")
    commands = raw["command"] if isinstance(raw["command"], list) else [raw["command"]]
    return Figure(raw["technique"], raw["figure"], raw["value"], tuple(commands), raw["machine"], raw["date"],
                  raw.get("id", ""))


def parse(data: dict) -> Results:
    """The checked contents of results.json; ConfigError names what is wrong and what is allowed."""
    machines = data.get("machines") or {}
    sections = []
    for s in data.get("sections", []):
        layout = s.get("layout", "rows")
        if layout not in LAYOUTS:
            raise ConfigError(f"section {s.get('title')!r}: layout {layout!r} is not one of {LAYOUTS}")
        figures = tuple(_figure(f, machines, f"section {s['title']!r}, figure {i + 1}")
                        for i, f in enumerate(s.get("figures", [])))
        sections.append(Section(s["title"], layout, s.get("text", ""), figures))
    results = Results(data.get("intro", ""), machines, tuple(sections),
                      tuple(ReadmeRow(r["what"], r["figure"], tuple(r["from"])) for r in data.get("readme", [])))
    ids = [f.id for f in results.figures() if f.id]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ConfigError(f"figure ids must be unique; repeated: {duplicates}")
    for row in results.readme:
        unknown = [i for i in row.sources if i not in results.by_id()]
        if not row.sources or unknown:
            raise ConfigError(f"README row {row.what!r}: 'from' must name figure ids; unknown: {unknown}")
    return results


def load(path: Path = DATA) -> Results:
    return parse(json.loads(path.read_text()))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(commands: tuple[str, ...]) -> str:
    return ", then ".join(f"`{_cell(c)}`" for c in commands)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _rows_table(figures: tuple[Figure, ...]) -> list[str]:
    lines = [_row(["technique", "figure", "value", "command", "machine", "date"]), _row(["---"] * 6)]
    for f in figures:
        lines.append(_row([_cell(f.technique), _cell(f.figure), _cell(f.value), _code(f.commands), f.machine,
                           f.date]))
    return lines


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _generic(command: str, row: str) -> str:
    return re.sub(rf"(?<![\w-]){re.escape(row)}(?![\w-])", GRID_PLACEHOLDER, command)


def _grid_table(figures: tuple[Figure, ...]) -> list[str]:
    """Rows are techniques, columns figures; under the table, each column's command (the row's name as FORMAT)."""
    rows = _unique([f.technique for f in figures])
    columns = _unique([f.figure for f in figures])
    cells = {(f.technique, f.figure): f for f in figures}
    lines = [_row([""] + [_cell(c) for c in columns]), _row(["---"] * (len(columns) + 1))]
    for r in rows:
        lines.append(_row([f"**{_cell(r)}**"] + [_cell(cells[r, c].value) if (r, c) in cells else "-"
                                                  for c in columns]))
    lines += ["", f"Measured by ({GRID_PLACEHOLDER}: the row's format):"]
    for c in columns:
        groups: dict[tuple, list[str]] = {}
        for r in rows:
            if (r, c) in cells:
                f = cells[r, c]
                key = (tuple(_generic(cmd, r) for cmd in f.commands), f.machine)
                groups.setdefault(key, []).append(r)
        for (commands, machine), members in groups.items():
            dates = " / ".join(_unique([cells[r, c].date for r in members]))
            scope = "" if len(groups) == 1 else f" ({', '.join(members)})"
            lines.append(f"- {_cell(c)}{scope}: {_code(commands)}; {machine}, {dates}")
    return lines


def render_results(results: Results) -> str:
    lines = ["# Measured results", "", results.intro, "", "| machine | CPU |", "|---|---|"]
    lines += [_row([name, _cell(cpu)]) for name, cpu in results.machines.items()]
    lines += ["", "Sections: " + " · ".join(f"[{s.title}](#{_anchor(s.title)})" for s in results.sections)]
    for s in results.sections:
        lines += ["", f"## {s.title}", ""]
        if s.text:
            lines += [s.text, ""]
        lines += _grid_table(s.figures) if s.layout == "grid" else _rows_table(s.figures)
    return "\n".join(lines) + "\n"


def _anchor(title: str) -> str:
    return re.sub(r"[^\w\- ]", "", title.lower()).strip().replace(" ", "-")


def render_readme_table(results: Results) -> str:
    lines = [README_BEGIN, "| what | figure |", "|---|---|"]
    lines += [_row([_cell(r.what), _cell(r.figure)]) for r in results.readme]
    return "\n".join(lines + [README_END])


def with_readme_table(readme: str, results: Results) -> str:
    """README.md with the text between the two markers replaced by the rendering."""
    start, end = readme.find(README_BEGIN), readme.find(README_END)
    if start < 0 or end < start:
        raise ConfigError(f"README.md needs the lines {README_BEGIN!r} and {README_END!r}, in that order")
    return readme[:start] + render_readme_table(results) + readme[end + len(README_END):]


NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")


def unsourced_numbers(row: ReadmeRow, results: Results) -> list[str]:
    """Numbers in a README row that none of the figures it names contains."""
    figures = results.by_id()
    source = " ".join(f"{figures[i].technique} {figures[i].figure} {figures[i].value}" for i in row.sources)
    known = set(NUMBER.findall(source))
    return [n for n in NUMBER.findall(row.figure) if n not in known]


def command_argv(command: str) -> list[str]:
    """The argv of a documented command: shell words without leading VAR=value assignments or a venv path."""
    words = shlex.split(command)
    while words and re.match(r"[A-Z_][A-Z0-9_]*=", words[0]):
        words.pop(0)
    if words:
        words[0] = words[0].rsplit("/", 1)[-1]
    return words


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvforge.bench.results_doc", description=__doc__)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when a document differs")
    args = parser.parse_args(argv)
    results = load()
    wanted = {RESULTS_MD: render_results(results), README: with_readme_table(README.read_text(), results)}
    stale = [p for p, text in wanted.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{p.relative_to(ROOT)} differs from the rendering of docs/results.json", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(wanted[p])
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
