"""Passkey retrieval: a number hidden at some depth of long filler text must be recalled after a question.

Accuracy by KV policy and depth (Mohtashami & Jaggi, "Landmark Attention", 2023, arXiv:2305.16300, the
task's origin). Greedy generation; a trial passes when the generated text contains the key.
"""
from __future__ import annotations

import random

from kvforge.progress import Progress
from kvforge.sampling_params import SamplingParams

INTRO = "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_prompt(tokenizer, length: int, depth: float, key: int) -> list[int]:
    """Token ids of about `length` tokens with the needle at fraction `depth` of the filler."""
    intro, needle, question = (tokenizer.encode(t) for t in (INTRO, NEEDLE.format(key=key), QUESTION))
    unit = tokenizer.encode(FILLER)
    room = max(0, length - len(intro) - len(needle) - len(question))
    filler = (unit * (room // len(unit) + 1))[:room]
    cut = int(depth * room) // len(unit) * len(unit)
    return intro + filler[:cut] + needle + filler[cut:] + question


def run_trials(engine, tokenizer, length: int, depths: list[float], trials: int, seed: int = 0,
               progress: str | None = None) -> dict:
    """Accuracy per depth for one engine (all its requests in one batch); progress: a label for a bar."""
    rng = random.Random(seed)
    cases = [(d, rng.randrange(10000, 99999)) for d in depths for _ in range(trials)]
    params = SamplingParams(temperature=0, max_tokens=8)
    ids = [engine.add_request(passkey_prompt(tokenizer, length, d, key), params) for d, key in cases]
    done = {}
    bar = Progress(progress or "", len(cases), progress is not None)
    while engine.has_unfinished_requests():
        finished = {o.request_id: o.token_ids for o in engine.step() if o.finished}
        bar.update(len(finished))
        done.update(finished)
    bar.close()
    hits = {d: 0 for d in depths}
    for rid, (d, key) in zip(ids, cases):
        hits[d] += str(key) in tokenizer.decode(done[rid])
    return {str(d): hits[d] / trials for d in depths}


def passkey_eval(loaded, length: int = 2048, depths: tuple[float, ...] = (0.1, 0.5, 0.9), trials: int = 2,
                 seed: int = 0, progress: bool = False, **options) -> dict:
    """Passkey accuracy under the full cache and under `options` (kv_policy, ...), in one run."""
    from kvforge.eval.ppl import engine_for

    tokens = (length + 16) * trials * len(depths)
    result = {"length": length, "trials": trials, "options": options,
              "labels": {"full": "baseline (fp32 full)", "policy": technique_label(
                  options.get("kv_cache_dtype", "fp32"), options.get("kv_policy"),
                  (options.get("kv_policy_options") or {}).get("budget"))}}
    for label, opts in (("full", {}), ("policy", options)):
        engine = engine_for(loaded, tokens, **opts)
        acc = run_trials(engine, loaded.tokenizer, length, list(depths), trials, seed,
                         f"passkey, {label}" if progress else None)
        result[label] = {"accuracy": acc, "mean": sum(acc.values()) / len(acc),
                         "peak_kv_bytes": engine.kv.peak_blocks_used * engine.kv.block_bytes}
    return result


def technique_label(kv_dtype: str, policy: str | None, budget) -> str:
    return f"{kv_dtype} {policy or 'full'}" + (f" {budget}" if policy and budget is not None else "")


def format_passkey(r: dict, technique: str) -> str:
    """Baseline (fp32 full cache) beside the technique, one row per depth."""
    width = max(12, len(technique))
    lines = [f"passkey, {r['length']} tokens, {r['trials']} keys per depth",
             f"{'depth':>8} {'baseline (fp32 full)':>20} {technique:>{width}}"]
    for d in r["full"]["accuracy"]:
        lines.append(f"{d:>8} {r['full']['accuracy'][d]:>20.2f} {r['policy']['accuracy'][d]:>{width}.2f}")
    lines.append(f"{'mean':>8} {r['full']['mean']:>20.2f} {r['policy']['mean']:>{width}.2f}   peak KV "
                 f"{r['full']['peak_kv_bytes'] / 2**20:.1f} MiB vs {r['policy']['peak_kv_bytes'] / 2**20:.1f} MiB")
    return "\n".join(lines)
