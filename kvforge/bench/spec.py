"""Speculative decoding: plain decoding vs each drafting method, on input-grounded and open-ended prompts.

Grounded prompts ask the model to copy, number or correct a passage of the shipped texts (output repeats
the input, where prompt lookup shines); chat prompts are open-ended. Greedy, so every method produces the
same tokens. Each group of prompts runs with speculation off and with each method back to back, in
alternating order (machine load drifts). `speedup` is the ratio of decode-phase output tok/s (steps where every request of a group
already has its first token; prefill is identical work), `cpu_speedup` that of decode-phase tokens per CPU-second of
the stepping thread (steadier on a shared machine), `e2e_speedup` that of whole wall times.

Methods: `ngram`; `ngram_ceiling` (prompt lookup whose drafts are cut where plain decoding's output departs from
them, all verified: every draft accepted, none that would be left out, the most any planner could make of these
drafts); `ngram_fixed` (`ngram` without adaptive planning: every sequence drafts all it can); `ngram_linear`
(the planner's cost as before the layer bridge: one line, 0.055 a row, whatever the step's size); `layer_skip` (the first fifth and the last two fifths of the layers, 0-5 and 18-29 on SmolLM2:
the best of the subsets tried on the untrained model, docs/history/results-log.md); `draft` with `draft_model` (without one, the target drafts for itself:
a correctness check that must accept every draft, never a speedup).
"""
from __future__ import annotations

import time
from collections.abc import Callable

from kvforge.bench.timing import Clock
from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.speculative.ngram import NgramIndex
from kvforge.errors import ConfigError
from kvforge.eval.texts import load_text
from kvforge.progress import Progress
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
METHODS = {"ngram": {"method": "ngram", "num_speculative_tokens": 5},
           "ngram_ceiling": {"method": "ngram", "num_speculative_tokens": 5, "adaptive": False},
           "ngram_fixed": {"method": "ngram", "num_speculative_tokens": 5, "adaptive": False},
           "ngram_linear": {"method": "ngram", "num_speculative_tokens": 5, "verify_row_cost": 0.055, "bridge_jump": 0.0,
                            "bridge_row_cost": 0.055},
           "layer_skip": {"method": "layer_skip", "num_speculative_tokens": 3},
           "draft": {"method": "draft", "num_speculative_tokens": 3}}
DEFAULT_METHODS = ("ngram", "layer_skip")


GROUNDED_TEXTS = ("hamlet", "macbeth", "gpl-3")
SKIP_COUNTERS = ("spec_num_skipped_", "spec_num_probes", "spec_num_trimmed_", "spec_num_draft_tokens")


def skip_layers(num_layers: int) -> list[int]:
    """The layer_skip arm's drafter: the first fifth and the last two fifths of the layers."""
    return [*range(round(num_layers / 5)), *range(num_layers - max(1, round(num_layers * 2 / 5)), num_layers)]


def grounded_prompts(tokenizer, count: int, passage_tokens: int, texts=GROUNDED_TEXTS) -> list[list[int]]:
    sources = [load_text(t) for t in texts]
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


class _CutIndex(NgramIndex):
    """Prompt lookup that knows plain decoding's output (`reference`, after a prompt of `prompt_len` tokens) and cuts
    each proposal where it departs from it."""

    def __init__(self, min_n: int, max_n: int, prompt_len: int, reference: list[int]):
        super().__init__(min_n, max_n)
        self.prompt_len, self.reference = prompt_len, reference

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        drafts, truth = super().propose(token_ids, k), self.reference[len(token_ids) - self.prompt_len:]
        kept = 0
        while kept < min(len(drafts), len(truth)) and drafts[kept] == truth[kept]:
            kept += 1
        return drafts[:kept]


class _Arm:
    """One engine (speculation off, or one method) and what it measured over the groups it ran."""

    def __init__(self, loaded, speculative: dict | None, batch: int):
        self.speculative = speculative
        self.engine = LLMEngine(EngineConfig(kv_cache_memory=1 << 30, max_num_seqs=batch, enable_prefix_caching=False,
                                             speculative=speculative), loaded)
        self.seconds = self.decode_seconds = self.decode_cpu_seconds = 0.0
        self.decode_tokens = 0
        self.outputs: list[list[int]] = []

    def know_outputs(self, references: dict[tuple[int, ...], list[int]]) -> None:
        """Draft with _CutIndex: prompt lookup cut to plain decoding's output of each prompt."""
        spec = self.engine.runner.speculator
        lo, hi = spec.config.prompt_lookup_min, spec.config.prompt_lookup_max
        spec.new_index = lambda seq: _CutIndex(lo, hi, len(seq.prompt_token_ids),
                                               references[tuple(seq.prompt_token_ids)])

    def run_group(self, prompts: list[list[int]], max_tokens: int) -> None:
        engine, params = self.engine, SamplingParams(temperature=0, max_tokens=max_tokens)
        start = time.perf_counter()
        ids = [engine.add_request(p, params) for p in prompts]
        started: set[str] = set()
        done = {}
        while engine.has_unfinished_requests():
            decoding, clock = len(started) == len(ids), Clock()
            outs = engine.step()
            if decoding:  # every request of the group has its first token: a pure decode step
                spent = clock.split()
                self.decode_seconds += spent.wall
                self.decode_cpu_seconds += spent.cpu
                self.decode_tokens += sum(len(o.new_token_ids) for o in outs)
            for o in outs:
                started.add(o.request_id)
                if o.finished:
                    done[o.request_id] = o.token_ids
        self.seconds += time.perf_counter() - start
        self.outputs += [done[i] for i in ids]

    def row(self) -> dict:
        tokens = sum(len(t) for t in self.outputs)
        row = {"seconds": self.seconds, "output_tokens": tokens, "output_tok_s": tokens / self.seconds,
               "decode_seconds": self.decode_seconds, "decode_cpu_seconds": self.decode_cpu_seconds,
               "decode_tok_s": self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0,
               "decode_tok_per_cpu_s": self.decode_tokens / self.decode_cpu_seconds if self.decode_cpu_seconds else 0.0}
        if self.speculative:
            s = self.engine.stats()
            row.update({"acceptance_rate": s["spec_acceptance_rate"],
                        "mean_acceptance_length": s["spec_mean_acceptance_length"],
                        "acceptance_per_position": s["spec_acceptance_per_position"],
                        "draft_time_share": s["spec_draft_seconds"] / self.seconds,
                        **{k[len("spec_"):]: v for k, v in s.items() if k.startswith(SKIP_COUNTERS)}})
        return row


def _compare(loaded, methods: dict, prompts: list[list[int]], batch: int, max_tokens: int, label: str,
             show: bool, rounds: int = 1) -> tuple[dict, dict]:
    """Every group of `batch` prompts runs on each arm back to back, in alternating order, so a change in
    machine load hits all arms alike; `rounds` times over."""
    arms = {"off": _Arm(loaded, None, batch), **{name: _Arm(loaded, spec, batch) for name, spec in methods.items()}}
    order = list(arms)
    groups = [prompts[i: i + batch] for i in range(0, len(prompts), batch)]
    if "ngram_ceiling" in arms:  # plain decoding's outputs first, untimed
        plain = _Arm(loaded, None, batch)
        for group in groups:
            plain.run_group(group, max_tokens)
        arms["ngram_ceiling"].know_outputs({tuple(p): out for p, out in zip(prompts, plain.outputs)})
    progress = Progress(label, rounds * len(groups) * len(arms), show)
    for r in range(rounds):
        for g, group in enumerate(groups):
            for name in order if (g + r) % 2 == 0 else order[::-1]:
                arms[name].run_group(group, max_tokens)
                progress.update()
    progress.close()
    off = arms.pop("off")
    off_row, rows = off.row(), {}
    for name, arm in arms.items():
        row = arm.row()
        row["same_output"] = arm.outputs == off.outputs
        row["speedup"] = row["decode_tok_s"] / off_row["decode_tok_s"]  # decode phase: prefill is the same work
        row["cpu_speedup"] = row["decode_tok_per_cpu_s"] / off_row["decode_tok_per_cpu_s"]
        row["e2e_speedup"] = off.seconds / arm.seconds
        rows[name] = row
    return off_row, rows


def spec_bench(loaded, methods: list[str] | None = None, batches: tuple[int, ...] = (1, 8), prompts_b1: int = 3,
               max_tokens: int = 96, passage_tokens: int = 400, show: bool = True,
               workloads: dict[str, Callable[[int], list[list[int]]]] | None = None, texts=GROUNDED_TEXTS,
               spec_options: dict | None = None, draft_model: str | None = None, rounds: int = 1) -> dict:
    """workloads: name -> prompts for a count (default: 'grounded' from `texts` and 'chat', on the model's
    tokenizer); spec_options override every method's options (e.g. num_speculative_tokens); draft_model: the
    `draft` method's model (default methods then include it; without one `draft` drafts with the target itself);
    rounds: times each group runs on every arm (order alternating)."""
    if not isinstance(rounds, int) or rounds < 1:
        raise ConfigError(f"spec bench: rounds must be an integer >= 1, got {rounds!r}")
    tok = loaded.tokenizer
    workloads = workloads or {"grounded": lambda n: grounded_prompts(tok, n, passage_tokens, texts),
                              "chat": lambda n: chat_prompts(tok, n)}
    names = methods or [*DEFAULT_METHODS, *(["draft"] if draft_model else [])]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ConfigError(f"spec bench: unknown methods {unknown}; allowed: {', '.join(METHODS)}")
    methods = {name: {**METHODS[name], **(spec_options or {})} for name in names}
    if "layer_skip" in methods and not {"layers", "num_layers"} & set(spec_options or {}):
        methods["layer_skip"]["layers"] = skip_layers(loaded.config.num_layers)
    if "draft" in methods:
        methods["draft"]["model"] = draft_model or loaded.path
    result: dict = {"max_tokens": max_tokens, "passage_tokens": passage_tokens, "texts": list(texts),
                    "methods": methods, "off": {}, "self_draft": "draft" in methods and not draft_model}
    for name in methods:
        result[name] = {}
    for workload, make_prompts in workloads.items():
        for batch in batches:
            prompts = make_prompts(prompts_b1 if batch == 1 else batch)
            key = f"b{batch}"
            off, rows = _compare(loaded, methods, prompts, batch, max_tokens, f"{workload} {key}", show, rounds)
            result["off"].setdefault(workload, {})[key] = off
            for name, row in rows.items():
                result[name].setdefault(workload, {})[key] = row
    return result
