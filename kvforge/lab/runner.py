"""`kvforge lab`: check the inputs, plan the cells, measure the ones not cached yet, always write the report."""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field

from kvforge.errors import ConfigError
from kvforge.lab.cache import CellCache
from kvforge.lab.cells import Cell
from kvforge.lab.matrix import plan
from kvforge.lab.measure import LabContext, run_cell
from kvforge.lab.options import LabOptions, settings_for
from kvforge.lab.progress import CellProgress
from kvforge.version import package_version


@dataclass
class LabRun:
    out: str
    records: dict[Cell, dict]  # finished cells (measured now or reused)
    cells: list[Cell]
    measured: list[str] = field(default_factory=list)  # names (kind: label) of the cells measured in this run
    reused: list[str] = field(default_factory=list)
    interrupted: bool = False
    seconds: float = 0.0


def resolve_text(text: str) -> tuple[str, str, list[str]]:
    """(text, name, flags a single command takes): a named text, else a file path."""
    from kvforge.eval.texts import is_named, load_text, text_names

    if is_named(text) and not os.path.isfile(text):
        return load_text(text), text, ["--text", text]
    if not os.path.isfile(text):
        raise ConfigError(f"--text {text!r} is neither a readable file nor a named text "
                          f"({', '.join(text_names())}, or several joined with '+')")
    return load_text(path=text), text, ["--text-file", os.path.abspath(text)]


def model_identity(loaded) -> dict:
    """The tiers' ModelKey of the model (weights fingerprint, config as loaded): new weights or config at the same
    path measure again."""
    from kvforge.kv.tiers.keys import ModelKey

    return ModelKey.of(loaded.model, loaded.config).describe()


def check_formats(specs: list[str], config) -> None:
    """Every format can store this model's KV (e.g. a group size that divides head_dim)."""
    from kvforge.kv.formats import get_format, parse_format_spec

    spec = config.kv_cache_spec()
    for text in specs:
        name, opts = parse_format_spec(text)
        get_format(name, **opts).validate(spec, 16)


def prepare(options: LabOptions) -> tuple[LabContext, list[Cell], dict]:
    """Everything that can fail on bad input, before any cell runs: (context, cells, cache key context)."""
    from kvforge.models.loader import load_model

    options.check_out_dir()
    text, name, text_args = resolve_text(options.text)
    loaded = load_model(options.model)
    if loaded.tokenizer is None:
        raise ConfigError(f"model {loaded.path!r} has no tokenizer (tokenizer.json); the lab scores text")
    check_formats(options.formats, loaded.config)
    all_ids = loaded.tokenizer.encode(text)
    settings = settings_for(options, loaded.config.max_position_embeddings, len(all_ids))
    ctx = LabContext(loaded, text, name, text_args, loaded.path if options.model else None,
                     all_ids[:settings.tokens], settings)
    key_context = {"model": model_identity(loaded), "text": hashlib.sha256(text.encode()).hexdigest(),
                   "kvforge": package_version()}
    return ctx, plan(options, settings, bool(loaded.tokenizer.chat_template)), key_context


def run_lab(options: LabOptions) -> tuple[LabRun, LabContext]:
    """Measure the plan's missing cells; on Ctrl-C stop and keep what finished. Writes the report either way."""
    from kvforge.lab.report import write_report

    t0 = time.perf_counter()
    ctx, cells, key_context = prepare(options)
    cache = CellCache(options.out, key_context)
    run = LabRun(options.out, {}, cells)
    todo = []
    for cell in cells:
        record = None if cell.skip else cache.get(cell)
        if record is not None:
            run.records[cell] = record
            run.reused.append(cell.name)
        elif not cell.skip:
            todo.append(cell)
    progress = CellProgress(todo, options.progress)
    try:
        for cell in todo:
            progress.begin(cell)
            start = time.perf_counter()
            result = run_cell(ctx, cell)
            run.records[cell] = cache.put(cell, result, time.perf_counter() - start)
            run.measured.append(cell.name)
            progress.finish(cell)
    except KeyboardInterrupt:
        run.interrupted = True
    finally:
        progress.close()
    run.seconds = time.perf_counter() - t0
    write_report(run, ctx, options)
    return run, ctx
