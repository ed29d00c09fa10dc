"""Each cell kind measured by the single command that owns it (eval ppl, eval passkey, bench kv-formats,
advise --measure); the lab only chooses the inputs. Each returns the figures and the command that reproduces them."""
from __future__ import annotations

import importlib.util
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvforge.kv.formats import parse_format_spec
from kvforge.lab.cells import Cell
from kvforge.lab.options import Settings


@dataclass
class LabContext:
    loaded: Any  # kvforge.models.loader.LoadedModel
    text: str
    text_name: str  # "hamlet" or the file's path
    text_args: list[str]  # how a single command names the same text: --text hamlet, or --text-file PATH
    model_path: str | None  # None for the embedded model
    ids: list[int]  # the quality text's token ids (settings.tokens of them)
    settings: Settings


def engine_options(spec: str, policy: str | None = None, budget: int | None = None) -> dict[str, Any]:
    """The keyword arguments `kvforge eval ppl --kv-dtype ... --kv-policy ... --budget ...` builds its engine with."""
    name, opts = parse_format_spec(spec)
    return {"kv_cache_dtype": name, "kv_cache_options": opts or None, "kv_policy": policy,
            "kv_policy_options": {"budget": budget} if policy else None}


def _format_flags(spec: str) -> list[str]:
    name, opts = parse_format_spec(spec)
    return ["--kv-dtype", name] + (["--kv-options", spec.partition(":")[2]] if opts else [])


def _command(ctx: LabContext, *words: str | float) -> str:
    model = ["--model", ctx.model_path] if ctx.model_path else []
    return shlex.join(["kvforge", *(str(w) for w in words), *model])


def measure_quality(ctx: LabContext, p: dict) -> dict:
    """Decode-faithful perplexity of one format (+ policy) on the quality text, as `kvforge eval ppl` scores it."""
    from kvforge.eval.ppl import engine_for, perplexity
    from kvforge.eval.texts import load_text
    from kvforge.kv.memory import bytes_per_token

    ids, text_args = ctx.ids, ctx.text_args
    if p.get("text"):
        ids, text_args = ctx.loaded.tokenizer.encode(load_text(p["text"]))[: p["tokens"]], ["--text", p["text"]]
    engine = engine_for(ctx.loaded, len(ids), **engine_options(p["format"], p["policy"], p["budget"]))
    r = perplexity(engine, ids)
    policy = ["--kv-policy", p["policy"], "--budget", p["budget"]] if p["policy"] else []
    return {"ppl": r["ppl"], "peak_kv_bytes": r["peak_kv_bytes"], "tokens": r["tokens"],
            "kv_bytes_per_token": bytes_per_token(engine.kv_spec, engine.format, engine.kv.block_size),
            "command": _command(ctx, "eval", "ppl", *text_args, "--max-tokens", len(ids),
                                *_format_flags(p["format"]), *policy, "--agreement-prompts", 0, "--json")}


def measure_retrieval(ctx: LabContext, p: dict) -> dict:
    """Exact-match accuracy per task and length, several questions after one context (`kvforge eval retrieval`)."""
    from kvforge.eval.ppl import engine_for
    from kvforge.eval.retrieval import encode_case, held_bytes, make_cases, retrieval_scores

    tok = ctx.loaded.tokenizer
    cases = make_cases(tok, p["tasks"], p["lengths"], p["contexts"], p["questions"], p["seed"])
    longest = max(len(encode_case(tok, c, ids)[0]) for _, _, c, ids in cases)
    engine = engine_for(ctx.loaded, longest, **engine_options("fp32", p["policy"], p["budget"]))
    held: list[int] = []
    accuracy = retrieval_scores(engine, tok, cases, p["chunk_size"], held=held)
    policy = ["--kv-policy", p["policy"], "--budget", p["budget"]] if p["policy"] else []
    return {"accuracy": accuracy, "peak_kv_bytes": engine.kv.peak_blocks_used * engine.kv.block_bytes,
            "context_kv_bytes": held_bytes(engine, held),
            "command": _command(ctx, "eval", "retrieval", "--tasks", ",".join(p["tasks"]), "--lengths",
                                ",".join(map(str, p["lengths"])), "--contexts", p["contexts"], "--questions",
                                p["questions"], "--chunk-size", p["chunk_size"], "--seed", p["seed"], *policy,
                                "--json")}


def measure_speed(ctx: LabContext, p: dict) -> dict:
    """One format's bytes/token, sequences per budget and decode speed vs fp32 (`kvforge bench kv-formats`)."""
    from kvforge.bench.kv_formats import kv_formats_bench

    s = ctx.settings.speed
    r = kv_formats_bench(ctx.loaded, [p["format"]], s["budget"], s["seq_len"], s["batch"], s["steps"], rounds=s["rounds"])
    return {**r["formats"][p["format"]], "fp32_decode_tok_s": r["fp32_decode_tok_s"],
            "fp16_sequences_fit": r["fp16_sequences_fit"], "threads": r["threads"],
            "command": _command(ctx, "bench", "kv-formats", "--formats", p["format"], "--budget", f"{s['budget']}B",
                                "--seq-len", s["seq_len"], "--batch", s["batch"], "--steps", s["steps"],
                                "--rounds", s["rounds"], "--json")}


def measure_long(ctx: LabContext, p: dict) -> dict:
    """Perplexity per segment over a text longer than the context under StreamingLLM (`kvforge eval ppl --segment`).

    With p["baseline"] the fp32 full cache is scored too, over the part of the text inside the context (as eval ppl
    does); quick runs leave that out (it costs more than the streaming run itself)."""
    from kvforge.eval.ppl import engine_for, perplexity, ppl_eval

    options = {"kv_policy": "streaming", "kv_policy_options": {"budget": p["budget"]}}
    if p["baseline"]:
        r = ppl_eval(ctx.loaded, ctx.text, p["tokens"], p["chunk_size"], 0, segment=p["segment"], **options)
    else:
        ids = ctx.loaded.tokenizer.encode(ctx.text)[:p["tokens"]]
        r = perplexity(engine_for(ctx.loaded, len(ids), **options), ids, p["chunk_size"], p["segment"])
    return {**r, "command": _command(ctx, "eval", "ppl", *ctx.text_args, "--max-tokens", p["tokens"],
                                     "--chunk-size", p["chunk_size"], "--segment", p["segment"], "--kv-policy",
                                     "streaming", "--budget", p["budget"], "--agreement-prompts", 0, "--json")}


def measure_passkey(ctx: LabContext, p: dict) -> dict:
    """Passkey accuracy per depth at one length, full cache and one policy (`kvforge eval passkey`)."""
    from kvforge.eval.passkey import passkey_eval

    r = passkey_eval(ctx.loaded, p["length"], tuple(p["depths"]), p["trials"], kv_cache_dtype="fp32",
                     kv_policy=p["policy"], kv_policy_options={"budget": p["budget"]})
    return {**r, "command": _command(ctx, "eval", "passkey", "--length", p["length"], "--depths",
                                     ",".join(str(d) for d in p["depths"]), "--trials", p["trials"],
                                     "--kv-policy", p["policy"], "--budget", p["budget"], "--json")}


def measure_advise(ctx: LabContext, p: dict) -> dict:
    """`kvforge advise --measure` on the lab's candidates: ranked by measured memory, quality and speed."""
    from kvforge.advise import DEFAULT_MAX_LOSS, measure, parse_candidates

    loss = DEFAULT_MAX_LOSS[p["priority"]]
    m = measure(ctx.loaded, parse_candidates(p["candidates"]), ctx.text, p["eval_tokens"], p["priority"], loss,
                requests=p["requests"], output_tokens=p["output_tokens"], text_name=ctx.text_name)
    words = ["advise", *([ctx.model_path] if ctx.model_path else []), "--measure", "--candidates", p["candidates"], "--eval-tokens",
             p["eval_tokens"], *ctx.text_args, "--priority", p["priority"], "--requests", p["requests"],
             "--output-tokens", p["output_tokens"], "--json"]
    return {**m.to_dict(), "command": shlex.join(["kvforge", *(str(w) for w in words)])}


def measure_speculative(ctx: LabContext, p: dict) -> dict:
    """Plain decoding vs ngram drafting on grounded and chat prompts (`kvforge bench spec`)."""
    from kvforge.bench.spec import spec_bench

    r = spec_bench(ctx.loaded, ["ngram"], tuple(p["batches"]), p["prompts"], p["max_tokens"], p["passage_tokens"],
                   show=False)
    return {**r, "command": _command(ctx, "bench", "spec", "--methods", "ngram", "--batches", *p["batches"],
                                     "--prompts", p["prompts"], "--max-tokens", p["max_tokens"], "--passage-tokens",
                                     p["passage_tokens"], "--no-progress", "--json")}


def engine_lacks(module: str, feature: str) -> Callable[[], str | None]:
    """A hook for kinds the engine does not have yet: the note the report shows instead of figures.

    When the engine gains the feature, add a measurer to MEASURERS and the note goes away."""
    def check() -> str | None:
        if importlib.util.find_spec(module) is None:
            return f"skipped: the engine has no {feature} yet ({module} is not built)"
        return f"skipped: {feature} is built but the lab has no measurement for it yet"
    return check


MEASURERS: dict[str, Callable[[LabContext, dict], dict]] = {
    "quality": measure_quality, "retrieval": measure_retrieval, "speed": measure_speed, "long": measure_long, "passkey": measure_passkey,
    "advise": measure_advise, "speculative": measure_speculative,
}
SKIPPED: dict[str, Callable[[], str | None]] = {
    "tiers": engine_lacks("kvforge.kv.tiers", "KV tiers (device -> host -> disk)"),
}


def run_cell(ctx: LabContext, cell: Cell) -> dict:
    return MEASURERS[cell.kind](ctx, cell.params)
