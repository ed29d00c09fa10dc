"""Passkey retrieval: a number hidden at some depth of long filler text must be recalled after a question.

Accuracy by KV policy and depth (Mohtashami & Jaggi, "Landmark Attention", 2023, arXiv:2305.16300, the
task's origin). Greedy generation; a trial passes when the generated text contains the key.
"""
from __future__ import annotations

import json
import random
import sys

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


def run_trials(engine, tokenizer, length: int, depths: list[float], trials: int, seed: int = 0) -> dict:
    """Accuracy per depth for one engine (all its requests in one batch)."""
    rng = random.Random(seed)
    cases = [(d, rng.randrange(10000, 99999)) for d in depths for _ in range(trials)]
    params = SamplingParams(temperature=0, max_tokens=8)
    ids = [engine.add_request(passkey_prompt(tokenizer, length, d, key), params) for d, key in cases]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    hits = {d: 0 for d in depths}
    for rid, (d, key) in zip(ids, cases):
        hits[d] += str(key) in tokenizer.decode(done[rid])
    return {str(d): hits[d] / trials for d in depths}


def passkey_eval(loaded, length: int = 2048, depths: tuple[float, ...] = (0.1, 0.5, 0.9), trials: int = 2,
                 seed: int = 0, **options) -> dict:
    """Passkey accuracy under the full cache and under `options` (kv_policy, ...), in one run."""
    from kvforge.eval.ppl import engine_for

    tokens = (length + 16) * trials * len(depths)
    result = {"length": length, "trials": trials, "options": options}
    for label, opts in (("full", {}), ("policy", options)):
        engine = engine_for(loaded, tokens, **opts)
        acc = run_trials(engine, loaded.tokenizer, length, list(depths), trials, seed)
        result[label] = {"accuracy": acc, "mean": sum(acc.values()) / len(acc),
                         "peak_kv_bytes": engine.kv.peak_blocks_used * engine.kv.block_bytes}
    return result


def register_passkey(esub) -> None:
    from kvforge.cli.common import add_policy_options

    p = esub.add_parser("passkey", help="recall a number hidden in long filler text, by KV policy and depth")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--kv-dtype", "--kv-cache-dtype", dest="kv_dtype", default="fp32", help="KV storage format")
    p.add_argument("--length", type=int, default=2048, help="prompt length in tokens")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="comma-separated needle depths in [0, 1]")
    p.add_argument("--trials", type=int, default=2, help="keys per depth")
    p.add_argument("--json", action="store_true", help="print JSON")
    add_policy_options(p)
    p.set_defaults(func=run_passkey)


def run_passkey(args) -> int:
    from kvforge.cli.common import policy_kwargs
    from kvforge.errors import ConfigError
    from kvforge.models.loader import load_model

    try:
        depths = tuple(float(d) for d in args.depths.split(","))
    except ValueError:
        raise ConfigError(f"--depths must be comma-separated numbers in [0, 1], got {args.depths!r}") from None
    if not all(0 <= d <= 1 for d in depths) or args.trials < 1 or args.length < 64:
        raise ConfigError("--depths must lie in [0, 1], --trials >= 1 and --length >= 64")
    loaded = load_model(args.model)
    r = passkey_eval(loaded, args.length, depths, args.trials, kv_cache_dtype=args.kv_dtype, **policy_kwargs(args))
    if args.json:
        json.dump(r, sys.stdout, indent=2)
        print()
        return 0
    print(f"passkey, {args.length} tokens, {args.trials} keys per depth")
    print(f"{'depth':>8} {'full':>6} {args.kv_policy or 'full':>12}")
    for d in r["full"]["accuracy"]:
        print(f"{d:>8} {r['full']['accuracy'][d]:>6.2f} {r['policy']['accuracy'][d]:>12.2f}")
    print(f"{'mean':>8} {r['full']['mean']:>6.2f} {r['policy']['mean']:>12.2f}   peak KV "
          f"{r['full']['peak_kv_bytes'] / 2**20:.1f} MiB vs {r['policy']['peak_kv_bytes'] / 2**20:.1f} MiB")
    return 0
