"""Weight kinds side by side (two of fp32, weight-only int8, auto: a GGUF's blocks as stored, q8_0 / q4_0: an fp32
model quantized at load): prefill and decode tok/s per batch size on llama.cpp's batched-bench shapes, through
`bench/llama_cpp.py`'s kvforge runner and round loop: each batch size runs both kinds once per round, alternating
their order, medians over rounds, wall clock and (at one thread) per second of the thread's CPU time, which other
jobs on a shared machine inflate much less. `ratio.decode_bN` = the second kind / the first. Also each kind's
resident weight bytes (the engine's `weight_bytes`) and, with `ppl_tokens`, its perplexity on a text (fp32 KV) and
the second kind's delta against the first.
"""
from __future__ import annotations

from kvforge.bench.llama_cpp import KvforgeRunner, measure
from kvforge.errors import ConfigError


def perplexities(loaded, kinds: tuple[str, ...], text: str, tokens: int) -> dict:
    """Each kind's perplexity on the first `tokens` tokens of a named text (kvforge/eval/texts.py), fp32 KV."""
    from kvforge.eval.ppl import engine_for, perplexity
    from kvforge.eval.texts import load_text

    ids = loaded.tokenizer.encode(load_text(text))[:tokens]
    ppl = {kind: perplexity(engine_for(loaded, len(ids), weights=kind), ids)["ppl"] for kind in kinds}
    base, other = kinds
    return {"text": text, "tokens": len(ids), "ppl": ppl, "delta_pct": 100 * (ppl[other] - ppl[base]) / ppl[base]}


def weights_bench(loaded, kinds: tuple[str, ...] = ("fp32", "int8"), npp: int = 128, ntg: int = 64,
                  npl: tuple[int, ...] = (1, 8), rounds: int = 3, seed: int = 0, ppl_tokens: int = 0,
                  ppl_text: str = "hamlet") -> dict:
    if len(kinds) != 2 or rounds < 1:
        raise ConfigError(f"give two weight kinds (baseline first) and rounds >= 1, got {list(kinds)} and {rounds}")
    npl = list(npl)
    runners = {kind: KvforgeRunner(loaded, npp, ntg, max(npl), kind) for kind in kinds}
    rows = measure(runners, npp, ntg, npl, rounds, loaded.config.vocab_size, seed)
    base, other = kinds
    result = {"npp": npp, "ntg": ntg, "npl": npl, "rounds": rounds, "kinds": list(kinds), **rows,
              "weight_bytes": {kind: runner.engine.weight_bytes for kind, runner in runners.items()}}
    result["weight_bytes_ratio"] = result["weight_bytes"][kinds[1]] / result["weight_bytes"][kinds[0]]
    if ppl_tokens:
        result["perplexity"] = perplexities(loaded, kinds, ppl_text, ppl_tokens)
    for key, name in (("tok_s", "ratio"), ("tok_per_cpu_s", "ratio_cpu")):
        result[name] = {f"decode_b{pl}": rows[other][f"b{pl}"][f"decode_{key}"] / rows[base][f"b{pl}"][f"decode_{key}"]
                        for pl in npl}
    return result
