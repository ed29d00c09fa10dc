"""docs/results.md and README's "Measured" table are the rendering of docs/results.json, and every command they
name is one the project really has (parsed, not run)."""
from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

from kvforge.bench import results_doc
from kvforge.cli import build_parser
from kvforge.errors import ConfigError

ROOT = results_doc.ROOT


@pytest.fixture(scope="module")
def results() -> results_doc.Results:
    return results_doc.load()


def test_results_md_is_the_rendering_of_results_json(results):
    assert results_doc.RESULTS_MD.read_text() == results_doc.render_results(results), (
        "docs/results.md differs from docs/results.json: edit the JSON, then `python -m kvforge.bench.results_doc`")


def test_readme_measured_table_is_the_rendering_of_results_json(results):
    readme = results_doc.README.read_text()
    assert results_doc.with_readme_table(readme, results) == readme, (
        "README.md's Measured table differs from docs/results.json: run `python -m kvforge.bench.results_doc`")


def test_every_readme_number_is_in_the_figures_it_names(results):
    unsourced = {row.what: results_doc.unsourced_numbers(row, results) for row in results.readme}
    assert {what: numbers for what, numbers in unsourced.items() if numbers} == {}


def _flags(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def _check_source(path: Path, argv: list[str]) -> str | None:
    source = path.read_text()
    missing = [f for f in _flags(argv) if f'"{f}"' not in source]
    return f"{path.relative_to(ROOT)} has no option {missing}" if missing else None


def _problem(command: str, parser: argparse.ArgumentParser) -> str | None:
    """Why a documented command would not run as written, or None."""
    argv = results_doc.command_argv(command)
    program, args = argv[0], argv[1:]
    if program == "kvforge":
        try:
            parser.parse_args(args)
        except SystemExit:
            return "the kvforge CLI refuses these arguments"
        return None
    if program in ("python", "python3") and args[:1] == ["-m"]:
        spec = importlib.util.find_spec(args[1])
        if spec is None or spec.origin is None:
            return f"no module {args[1]}"
        return _check_source(Path(spec.origin), args[2:])
    if program in ("python", "python3"):
        path = ROOT / args[0]
        return _check_source(path, args[1:]) if path.is_file() else f"no file {args[0]}"
    if program == "pytest":
        for target in (a for a in args if not a.startswith("-")):
            path, _, name = target.partition("::")
            if not (ROOT / path).is_file():
                return f"no test file {path}"
            if name and not re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.MULTILINE):
                return f"no test {name} in {path}"
        return None
    return f"{program!r} is none of kvforge, python, pytest"


def test_every_command_is_a_real_command(results, capsys):
    parser = build_parser()
    problems = {}
    for figure in results.figures():
        for command in figure.commands:
            problem = _problem(command, parser)
            if problem:
                problems[command] = problem
    capsys.readouterr()  # argparse's own messages for refused commands
    assert problems == {}


def test_a_wrong_flag_or_subcommand_is_caught():
    parser = build_parser()
    assert _problem("OMP_NUM_THREADS=1 kvforge bench kv-formats --json", parser) is None
    assert _problem("kvforge bench kv-formats --no-such-flag", parser) is not None
    assert _problem("kvforge bench no-such-bench --json", parser) is not None
    assert _problem(".venv/bin/python -m kvforge.bench.dispatch --batch 1 8 --no-such-flag", parser) is not None
    assert _problem(".venv/bin/python -m kvforge.no_such_module", parser) is not None
    assert _problem("pytest tests/no_such_test.py", parser) is not None


def _data(**figure) -> dict:
    base = {"technique": "t", "figure": "f", "value": "1.00x", "command": "kvforge bench memory --json",
            "machine": "m", "date": "2026-12-03"}
    return {"machines": {"m": "a CPU"}, "sections": [{"title": "s", "figures": [{**base, **figure}]}]}


@pytest.mark.parametrize("change, message", [
    ({"machine": "elsewhere"}, "machine 'elsewhere' is not one of ['m']"),
    ({"date": "yesterday"}, "date 'yesterday' is not YYYY-MM-DD"),
    ({"command": ""}, "missing command"),
    ({"speedup": 2}, "unknown field(s) ['speedup']"),
])
def test_a_bad_figure_is_refused_with_what_is_allowed(change, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        results_doc.parse(_data(**change))


def test_a_readme_row_must_name_figures_that_exist():
    data = _data(id="a")
    data["readme"] = [{"what": "w", "figure": "1.00x", "from": ["b"]}]
    with pytest.raises(ConfigError, match=re.escape("unknown: ['b']")):
        results_doc.parse(data)


def test_a_grid_lists_each_column_command_once_with_the_row_as_format():
    data = _data()
    data["sections"][0]["layout"] = "grid"
    data["sections"][0]["figures"] = [
        {"technique": fmt, "figure": "ppl", "value": v, "command": f"kvforge eval ppl --kv-dtype {fmt}",
         "machine": "m", "date": "2026-12-03"} for fmt, v in (("int8", "+0.1%"), ("int4", "+0.4%"))]
    text = results_doc.render_results(results_doc.parse(data))
    assert "| **int8** | +0.1% |" in text and "| **int4** | +0.4% |" in text
    assert "- ppl: `kvforge eval ppl --kv-dtype FORMAT`; m, 2026-12-03" in text
