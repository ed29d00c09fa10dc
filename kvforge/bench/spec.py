"""Speculative decoding: plain decoding vs each drafting method, on input-grounded and open-ended prompts.

Grounded prompts ask the model to copy, number or correct a passage of the shipped texts (output repeats
the input, where prompt lookup shines); chat prompts are open-ended. Greedy, so every method produces the
same tokens; `speedup` is the ratio of decode-phase output tok/s (steps where every request of a group
already has its first token; prefill is identical work), `e2e_speedup` that of whole wall times.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from kvforge.bench.progress import Progress
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.eval.texts import load_text
from kvforge.sampling_params import SamplingParams

TASKS = ("Copy the following passage exactly, keeping every line:\n\n{}",
         "Rewrite the following passage with each line numbered, changing nothing else:\n\n{}",
         "Fix any typos in the following passage and return the whole passage:\n\n{}")
CHAT = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how a refrigerator works to a ten-year-old.",
        "What are three good habits for learning a new language, and why?",
        "Describe your ideal weekend in the mountains.",
        "Give me a recipe idea for a rainy evening and explain each step.",
        "Why do cats purr? Answer in a friendly tone.",
        "Plan a one-day tour of an old European city.",
        "What makes a good team leader? Give examples.")
METHODS = {"ngram": {"method": "ngram", "num_speculative_tokens": 5}}


def grounded_prompts(tokenizer, count: int, passage_tokens: int) -> list[list[int]]:
    sources = [load_text("hamlet"), load_text("macbeth"), load_text("gpl-3")]
    prompts = []
    for i in range(count):
        ids = tokenizer.encode(sources[i % len(sources)])
        start = 400 + 977 * i
        passage = tokenizer.decode(ids[start: start + passage_tokens])
        prompts.append(_chat(tokenizer, TASKS[i % len(TASKS)].format(passage)))
    return prompts


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    return [_chat(tokenizer, CHAT[i % len(CHAT)]) for i in range(count)]


def _chat(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def _run(loaded, spec: dict | None, prompts: list[list[int]], batch: int, max_tokens: int, label: str,
         show: bool) -> dict:
    engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 30, max_num_seqs=batch, enable_prefix_caching=False,
                                    speculative=spec), loaded)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    progress = Progress(label, len(prompts), show)
    outputs, start = {}, time.perf_counter()
    decode_seconds, decode_tokens = 0.0, 0
    for first in range(0, len(prompts), batch):
        ids = [engine.add_request(p, params) for p in prompts[first: first + batch]]
        started: set[str] = set()
        while engine.has_unfinished_requests():
            decoding, t = len(started) == len(ids), time.perf_counter()
            outs = engine.step()
            if decoding:  # every request of the group has its first token: a pure decode step
                decode_seconds += time.perf_counter() - t
                decode_tokens += sum(len(o.new_token_ids) for o in outs)
            for o in outs:
                started.add(o.request_id)
                if o.finished:
                    outputs[o.request_id] = o.token_ids
                    progress.update()
    seconds = time.perf_counter() - start
    progress.close()
    s = engine.stats()
    tokens = sum(len(t) for t in outputs.values())
    row = {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
           "decode_seconds": decode_seconds, "decode_tok_s": decode_tokens / decode_seconds if decode_seconds else 0.0,
           "outputs": [outputs[k] for k in sorted(outputs, key=int)]}
    if spec:
        row.update({"acceptance_rate": s["spec_acceptance_rate"],
                    "mean_acceptance_length": s["spec_mean_acceptance_length"],
                    "acceptance_per_position": s["spec_acceptance_per_position"],
                    "draft_time_share": s["spec_draft_seconds"] / seconds})
    return row


def spec_bench(loaded, methods: list[str] | None = None, batches: tuple[int, ...] = (1, 8), prompts_b1: int = 3,
               max_tokens: int = 96, passage_tokens: int = 400, show: bool = True,
               workloads: dict[str, Callable[[int], list[list[int]]]] | None = None) -> dict:
    """workloads: name -> prompts for a count (default: 'grounded' and 'chat' on the model's tokenizer)."""
    tok = loaded.tokenizer
    workloads = workloads or {"grounded": lambda n: grounded_prompts(tok, n, passage_tokens),
                              "chat": lambda n: chat_prompts(tok, n)}
    result: dict = {"max_tokens": max_tokens, "passage_tokens": passage_tokens, "off": {}}
    for name in methods or list(METHODS):
        result[name] = {}
    for workload, make_prompts in workloads.items():
        for batch in batches:
            prompts = make_prompts(prompts_b1 if batch == 1 else batch)
            key = f"b{batch}"
            off = _run(loaded, None, prompts, batch, max_tokens, f"{workload} {key} off", show)
            result["off"].setdefault(workload, {})[key] = {k: v for k, v in off.items() if k != "outputs"}
            for name in methods or list(METHODS):
                on = _run(loaded, METHODS[name], prompts, batch, max_tokens, f"{workload} {key} {name}", show)
                on["same_output"] = on.pop("outputs") == off["outputs"]
                on["speedup"] = on["decode_tok_s"] / off["decode_tok_s"]  # decode phase: prefill is the same work
                on["e2e_speedup"] = off["seconds"] / on["seconds"]
                result[name].setdefault(workload, {})[key] = on
    return result
