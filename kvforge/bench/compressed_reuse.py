"""One context, several questions under kvzip: compressed once and reused (`reuse`), against each request compressed
on its own (its whole prompt: context + question), on the same generated retrieval cases.

Each question is a request (greedy, the answer's length + 2 tokens); an answer counts when the generation starts
with it. Prints, per mode: wall time, prefix hit rate, scoring passes, accuracy, peak KV blocks.
`python -m kvforge.bench.compressed_reuse [--length 2048 --questions 8 --budget 0.5]`.
"""
from __future__ import annotations

import argparse
import json
import random
import time

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.eval.retrieval import FILLER_TEXTS
from kvforge.eval.retrieval_tasks import TASKS, build_context, line_breaks
from kvforge.eval.texts import load_text
from kvforge.sampling_params import SamplingParams


def _generate(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o if o.finished else out
    return list(out.token_ids)


def run(loaded, length: int, questions: int, budget: float, reuse: bool, seed: int = 0) -> dict:
    tok = loaded.tokenizer
    filler = tok.encode("\n\n".join(load_text(t) for t in FILLER_TEXTS))
    rng = random.Random(f"{seed}-reuse-{length}")
    case = TASKS["niah_multikey"](rng, questions)
    context = build_context(tok, case, filler, line_breaks(tok, filler), length, rng)
    engine = LLMEngine(EngineConfig(kv_cache_memory="256MiB", kv_policy="kvzip", max_model_len=length + 256,
                                    kv_policy_options={"budget": budget, "reuse": reuse}), loaded)
    start = time.perf_counter()
    if reuse:
        _generate(engine, context, 1)  # the context on its own, compressed and kept
    right = 0
    for q in case.questions:
        answer = tok.encode(q.answer)
        got = _generate(engine, context + tok.encode("\n" + q.prompt), len(answer) + 2)
        right += got[: len(answer)] == answer
    s = engine.stats()
    return {"reuse": reuse, "seconds": round(time.perf_counter() - start, 2), "prefix_hit_rate": round(s["prefix_hit_rate"], 4),
            "scoring_passes": s["kv_compactions"], "accuracy": right / len(case.questions),
            "peak_kv_blocks": s["kv_blocks_used_peak"], "context_tokens": len(context), "questions": len(case.questions)}


def main(argv: list[str] | None = None) -> None:
    from kvforge.models.loader import load_model

    p = argparse.ArgumentParser(prog="python -m kvforge.bench.compressed_reuse", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--length", type=int, default=2048, help="context tokens (default 2048)")
    p.add_argument("--questions", type=int, default=8, help="questions (needles) per context (default 8)")
    p.add_argument("--budget", type=float, default=0.5, help="kvzip's kept share of the context (default 0.5)")
    args = p.parse_args(argv)
    loaded = load_model(args.model)
    rows = [run(loaded, args.length, args.questions, args.budget, reuse) for reuse in (True, False)]
    print(json.dumps({"rows": rows, "speedup": round(rows[1]["seconds"] / rows[0]["seconds"], 2)}, indent=1))


if __name__ == "__main__":
    main()
