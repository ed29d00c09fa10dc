"""Retrieval accuracy under a KV policy: several questions after one compressed context, by exact match.

One sequence per context: its prompt is the context alone (policies that compress once at the end of the
prompt, snapkv, kvzip, do so before any question), then every question and its answer follow, teacher-forced.
A question counts as answered when greedy decoding would write its answer exactly: every answer token is the
argmax given the tokens before it. Running policies keep compressing while the questions are read.
The full cache's own accuracy is the ceiling; tasks it does not solve (< 80% of items) are reported as such.
"""
from __future__ import annotations

import random
from itertools import pairwise

import torch

from kvforge.engine.scheduler import ScheduledBatch
from kvforge.engine.sequence import Sequence
from kvforge.errors import OutOfKVMemoryError
from kvforge.eval.retrieval_tasks import TASKS, Case, build_context, line_breaks
from kvforge.eval.texts import load_text
from kvforge.progress import Progress
from kvforge.sampling_params import SamplingParams

SOLVED = 0.8  # the full cache solves a task when it answers at least this share of its items
DEFAULT_LENGTHS = (1024, 2048)
FILLER_TEXTS = ("hamlet", "merry-wives", "gpl-3")


def encode_case(tokenizer, case: Case, context: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Context + questions and answers as one token list, and each answer's [start, end) token span."""
    ids, spans = list(context), []
    for q in case.questions:
        ids += tokenizer.encode("\n" + q.prompt)
        answer = tokenizer.encode(q.answer)
        spans.append((len(ids), len(ids) + len(answer)))
        ids += answer + tokenizer.encode("\n")
    return ids, spans


@torch.inference_mode()
def answered(engine, context_len: int, ids: list[int], spans: list[tuple[int, int]], chunk_size: int,
             held: list[int] | None = None) -> list[bool]:
    """For each answer span, whether every token of it is the model's argmax (teacher-forced greedy).
    held: gets the KV blocks in use once the context is in (and compressed), before the first question."""
    seq = Sequence("retrieval", None, ids[:context_len], SamplingParams(max_tokens=1), 0.0)
    seq.token_ids = list(ids)  # the prompt is the context; questions and answers follow it, teacher-forced
    runner, kv = engine.runner, engine.kv
    hits = torch.zeros(len(ids), dtype=torch.bool)
    cuts = [*range(0, context_len, chunk_size), *range(context_len, len(ids), chunk_size), len(ids)]
    try:
        for start, end in pairwise(cuts):
            if start == context_len and held is not None:
                held.append(kv.allocator.num_used)
            if not kv.allocate_slots(seq, end - start, prompt_window=False):
                raise OutOfKVMemoryError(f"the KV cache cannot hold {end} tokens of this sequence")
            batch = ScheduledBatch([seq], [end - start])
            hidden, _, stats = runner.forward(batch)
            engine.commit(batch, stats)
            if end > spans[0][0] - 1:
                pred = runner.model.compute_logits(hidden).argmax(-1).cpu()
                n = min(end - start, len(ids) - 1 - start)
                hits[start + 1: start + 1 + n] = pred[:n] == torch.tensor(ids[start + 1: start + 1 + n])
    finally:
        kv.free(seq)
    return [bool(hits[a:b].all()) for a, b in spans]


def make_cases(tokenizer, tasks: list[str], lengths: list[int], contexts: int, questions: int, seed: int):
    """(task, length, case, context ids) for every task x length x context, the same for every engine."""
    filler = tokenizer.encode("\n\n".join(load_text(t) for t in FILLER_TEXTS))
    breaks = line_breaks(tokenizer, filler)
    out = []
    for task in tasks:
        for length in lengths:
            for c in range(contexts):
                rng = random.Random(f"{seed}-{task}-{length}-{c}")
                case = TASKS[task](rng, questions)
                out.append((task, length, case, build_context(tokenizer, case, filler, breaks, length, rng)))
    return out


def retrieval_scores(engine, tokenizer, cases, chunk_size: int, progress: str | None = None,
                     held: list[int] | None = None) -> dict:
    """{task: {length: accuracy}} over every question of every context. held: gets each context's KV blocks in
    use before its first question."""
    bar = Progress(progress or "", len(cases), progress is not None)
    right: dict[str, dict[int, list[bool]]] = {}
    for task, length, case, context in cases:
        ids, spans = encode_case(tokenizer, case, context)
        right.setdefault(task, {}).setdefault(length, []).extend(answered(engine, len(context), ids, spans, chunk_size,
                                                                                held))
        bar.update(1)
    bar.close()
    return {t: {str(n): sum(r) / len(r) for n, r in by.items()} for t, by in right.items()}


def held_bytes(engine, held: list[int]) -> float:
    """Mean KV bytes a context held when its questions began (after any compression at the end of the context)."""
    return sum(held) / len(held) * engine.kv.block_bytes if held else 0.0


def retrieval_eval(loaded, tasks: list[str] | None = None, lengths: tuple[int, ...] = DEFAULT_LENGTHS,
                   contexts: int = 2, questions: int = 4, chunk_size: int = 64, seed: int = 0,
                   variants: dict[str, dict] | None = None, progress: bool = False, log=None) -> dict:
    """Accuracy of the full fp32 cache (the ceiling) and of each variant (label -> engine options: kv_policy,
    kv_cache_dtype, ...) on the same generated cases; tasks the full cache does not solve are marked, not ranked."""
    from kvforge.eval.ppl import engine_for

    tasks = tasks or list(TASKS)
    cases = make_cases(loaded.tokenizer, tasks, list(lengths), contexts, questions, seed)
    longest = max(len(encode_case(loaded.tokenizer, c, ctx)[0]) for _, _, c, ctx in cases)
    result = {"tasks": tasks, "lengths": list(lengths), "contexts": contexts, "questions": questions,
              "chunk_size": chunk_size, "seed": seed, "filler": list(FILLER_TEXTS), "variants": {}}
    for label, opts in (("full", {}), *(variants or {}).items()):
        engine = engine_for(loaded, longest, **opts)
        held: list[int] = []
        scores = retrieval_scores(engine, loaded.tokenizer, cases, chunk_size, f"retrieval, {label}" if progress else None,
                                  held)
        row = {"options": opts, "accuracy": scores, "peak_kv_bytes": engine.kv.peak_blocks_used * engine.kv.block_bytes,
               "context_kv_bytes": held_bytes(engine, held)}
        if label == "full":
            result["full"] = row
            result["solved"] = {t: {n: a >= SOLVED for n, a in by.items()} for t, by in scores.items()}
        else:
            full = result["full"]["accuracy"]
            row["relative"] = {t: {n: (a / full[t][n] if full[t][n] else None) for n, a in by.items()}
                               for t, by in scores.items()}
            result["variants"][label] = row
        if log:
            log(f"{label}: " + ", ".join(f"{t} {n} {a:.2f}" for t, by in scores.items() for n, a in by.items()))
    return result


def format_retrieval(r: dict) -> str:
    """One row per task and length: the full cache, then each variant's accuracy; unsolved tasks marked."""
    labels = list(r["variants"])
    width = max([8, *map(len, labels)])
    title = (f"retrieval: {r['contexts']} contexts per task and length, several questions after one context, exact "
             f"match (filler: {', '.join(r['filler'])})")
    lines = [title, f"{'task':<18} {'tokens':>6} {'full':>6}" + "".join(f" {v:>{width}}" for v in labels)]
    for t, by in r["full"]["accuracy"].items():
        for n, a in by.items():
            row = f"{t:<18} {n:>6} {a:>6.2f}" + "".join(f" {r['variants'][v]['accuracy'][t][n]:>{width}.2f}" for v in labels)
            lines.append(row + ("" if r["solved"][t][n] else "   (full cache < 0.8: not solved, not ranked)"))
    return "\n".join(lines)
