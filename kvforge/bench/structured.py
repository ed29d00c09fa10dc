"""Structured output: output tok/s on a JSON-schema workload with jump-forward (forced tokens as one prefill chunk)
and without (one masked decode step per forced token), in one run, rounds alternating the order of the two arms.

Each round runs the same greedy requests (chat prompts, each with one of SCHEMAS) through one engine per arm; every
output token counts, forced ones included (what a client receives). `identical` says both arms gave the same tokens.
"""
from __future__ import annotations

import statistics
import time

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.sampling_params import SamplingParams

SCHEMAS = [
    ("Give me a person as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["name", "age", "city", "email"],
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                       "city": {"enum": ["Paris", "London", "Berlin", "Madrid"]}, "email": {"type": "string"}}}),
    ("What is the weather in Paris? Answer with a tool call.", {
        "type": "object", "additionalProperties": False, "required": ["name", "arguments"],
        "properties": {"name": {"const": "get_weather"}, "arguments": {
            "type": "object", "additionalProperties": False, "required": ["city", "unit"],
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}),
    ("Describe a book as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["title", "author", "year", "genres"],
        "properties": {"title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"},
                       "genres": {"type": "array", "items": {"enum": ["fiction", "history", "science"]},
                                  "maxItems": 2}}}),
    ("Write an order for two items as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["order_id", "status", "items"],
        "properties": {"order_id": {"type": "integer"}, "status": {"enum": ["pending", "shipped", "delivered"]},
                       "items": {"type": "array", "maxItems": 2, "items": {
                           "type": "object", "additionalProperties": False, "required": ["sku", "quantity"],
                           "properties": {"sku": {"type": "string", "maxLength": 12},
                                          "quantity": {"type": "integer"}}}}}}),
]


def structured_bench(loaded, num_requests: int = 16, max_tokens: int = 96, rounds: int = 3,
                     kv_cache_memory: int = 256 << 20) -> dict:
    tok = loaded.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": SCHEMAS[i % len(SCHEMAS)][0]}]),
                          add_special_tokens=False) for i in range(num_requests)]
    schemas = [SCHEMAS[i % len(SCHEMAS)][1] for i in range(num_requests)]
    engines = {arm: LLMEngine(EngineConfig(kv_cache_memory=kv_cache_memory, max_model_len=1024,
                                           enable_prefix_caching=False), loaded) for arm in ("stepwise", "jump")}
    times: dict[str, list[float]] = {arm: [] for arm in engines}
    outputs: dict[str, list[list[int]]] = {}
    steps: dict[str, int] = {}
    for r in range(rounds):
        for arm in (("stepwise", "jump") if r % 2 == 0 else ("jump", "stepwise")):
            engine = engines[arm]
            params = [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs={"json": s},
                                     jump_forward=arm == "jump") for s in schemas]
            start = time.perf_counter()
            ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
            done, n = {}, 0
            while engine.has_unfinished_requests():
                done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
                n += 1
            times[arm].append(time.perf_counter() - start)
            outputs[arm], steps[arm] = [done[i] for i in ids], n
    tokens = sum(len(t) for t in outputs["jump"])
    result = {"num_requests": num_requests, "max_tokens": max_tokens, "rounds": rounds, "output_tokens": tokens,
              "identical": outputs["jump"] == outputs["stepwise"],
              "jump_forward_tokens_per_round": engines["jump"].stats()["jump_forward_tokens"] // rounds}
    for arm, engine in engines.items():
        seconds = statistics.median(times[arm])
        result[arm] = {"seconds": seconds, "output_tok_s": tokens / seconds, "steps": steps[arm]}
        engine.close()
    result["speedup"] = result["jump"]["output_tok_s"] / result["stepwise"]["output_tok_s"]
    return result


def register_structured(bsub) -> None:
    p = bsub.add_parser("structured", help="JSON-schema output tok/s with jump-forward vs one masked step per token")
    p.add_argument("--num-requests", type=int, default=16, help="requests, run together (schemas in turn)")
    p.add_argument("--max-tokens", type=int, default=96, help="most output tokens per request")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running both arms (medians reported)")
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: the embedded model)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run_structured)


def run_structured(args) -> int:
    import json

    from kvforge.models.loader import load_model

    r = structured_bench(load_model(args.model), args.num_requests, args.max_tokens, args.rounds)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    for arm in ("stepwise", "jump"):
        print(f"{arm:<9} {r[arm]['output_tok_s']:8.1f} output tok/s  ({r[arm]['steps']} steps, "
              f"{r[arm]['seconds']:.2f} s median of {r['rounds']})")
    print(f"speedup {r['speedup']:.2f}x; {r['output_tokens']} output tokens, {r['jump_forward_tokens_per_round']} "
          f"forced per round; identical outputs: {r['identical']}")
    return 0
