"""The lab's matrix: which cells one run measures, from the options and the settings derived for the model."""
from __future__ import annotations

from kvforge.lab.cells import Cell, quality_cell, retrieval_cell
from kvforge.lab.measure import SKIPPED
from kvforge.lab.options import LabOptions, Settings

HOOKS = {"tiers": "KV tiers"}  # kinds the engine does not have yet

BASELINE = "fp32"


def plan(options: LabOptions, s: Settings, has_chat_template: bool = True) -> list[Cell]:
    """Cells in the order they run: cheap, most-wanted figures first, so an interrupted run still says most."""
    cells = quality_cells(options, s)
    cells += retrieval_cells(options, s)
    cells += [Cell("speed", spec, {"format": spec, **s.speed}) for spec in options.formats]
    cells += [Cell("passkey", f"passkey {n} tokens", {"length": n, **{k: v for k, v in s.passkey.items() if k != "lengths"}})
              for n in s.passkey["lengths"]]
    short = None if s.long["tokens"] > s.context else (
        f"skipped: the text has {s.long['tokens']} tokens, not more than the model's context of {s.context}; "
        "give a longer --text for perplexity past the context")
    cells.append(Cell("long", f"streaming over {s.long['tokens']} tokens", dict(s.long), short))
    cells.append(Cell("advise", "advise --measure", {"candidates": ",".join(advise_candidates(options, s)),
                                                     **s.advise}))
    no_chat = None if has_chat_template else "skipped: the model's tokenizer has no chat template (bench spec prompts with one)"
    cells.append(Cell("speculative", "ngram drafting", dict(s.speculative), no_chat))
    cells += [Cell(kind, label, {}, SKIPPED[kind]()) for kind, label in HOOKS.items()]
    return cells


def quality_cells(options: LabOptions, s: Settings) -> list[Cell]:
    """The fp32 baseline, each format, each policy x budget and the combinations; with --panel, on every panel text."""
    from kvforge.eval.texts import PANEL

    n = s.tokens
    out = []
    for text in (list(PANEL) if options.panel else [None]):
        out += [quality_cell(n, BASELINE, text=text)]
        out += [quality_cell(n, spec, text=text) for spec in options.formats]
        out += [quality_cell(n, BASELINE, policy, b, text) for policy in options.policies for b in s.budgets]
        out += [quality_cell(n, BASELINE, m, f, text) for m in options.methods for f in options.fractions]
        out += [quality_cell(n, spec, policy, b, text) for spec in s.combo_formats for policy in options.policies
                for b in s.combo_budgets]
    return out


def retrieval_cells(options: LabOptions, s: Settings) -> list[Cell]:
    """The retrieval suite for the full cache (the ceiling) and each method at each share kept (none unless asked)."""
    if not s.retrieval:
        return []
    return [retrieval_cell(s.retrieval)] + [retrieval_cell(s.retrieval, m, f) for m in options.methods
                                            for f in options.fractions]


def advise_candidates(options: LabOptions, s: Settings) -> list[str]:
    """The formats without options (advise takes plain dtypes) and one policy x format combination."""
    plain = [f for f in options.formats if ":" not in f] or [BASELINE]
    combo = next((f for f in s.combo_formats if f in plain), plain[-1])
    return plain + [f"{combo}+{options.lead_policy}:{s.combo_budgets[0]}"]
