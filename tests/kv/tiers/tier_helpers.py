"""Shared by the tier tests: tiny engines with a small pool, documents asked twice, one request at a time."""
from __future__ import annotations

import threading

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.kv.formats import get_format
from kvforge.kv.memory import pool_bytes
from kvforge.kv.tiers.host import HostTier
from kvforge.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
BS = 8


def docs(n: int = 4, length: int = 34, vocab: int = 90) -> list[list[int]]:
    return [[(d * 31 + i * 7 + (i * i) % 11) % vocab + 3 for i in range(length)] for d in range(n)]


def engine(loaded, blocks: int = 8, tiers=None, fmt: str = "fp32", opts=None, **kw) -> LLMEngine:
    options = {"block_size": BS, "max_model_len": 64, "max_num_batched_tokens": 64, "kv_cache_dtype": fmt,
               "kv_cache_options": opts, "kv_cache_memory": 1 << 22, **kw}
    fmt_obj = get_format(fmt, **(opts or {}))
    options["kv_cache_memory"] = pool_bytes(loaded.config.kv_cache_spec(), fmt_obj, BS, blocks, EngineConfig.max_num_seqs)
    options.setdefault("kv_staging_share", 1.0)  # a pool of exactly `blocks` beside max_num_seqs' side buffers
    return LLMEngine(EngineConfig(kv_tiers=tiers, **options), loaded)


def ask_each(e: LLMEngine, prompts: list[list[int]], salt: str | None = None) -> list:
    """Run prompts one after another; returns the finished outputs in order."""
    outs = []
    for p in prompts:
        rid = e.add_request(p, GREEDY, cache_salt=salt)
        while e.has_unfinished_requests():
            for o in e.step():
                if o.finished and o.request_id == rid:
                    outs.append(o)
    return outs


def ask_flushed(e: LLMEngine, prompts: list[list[int]]) -> list:
    """ask_each with the tier stores written after each request (else the next may read them from the store
    queue, which counts as a hit of the first tier), so tier counters do not depend on thread timing."""
    outs = []
    for p in prompts:
        outs += ask_each(e, [p])
        e.tiers.flush()
    return outs


def twice(e: LLMEngine, n: int = 4) -> list:
    return ask_each(e, docs(n) + docs(n))


class GatedHost(HostTier):
    """A host tier whose put waits until the test opens `gate` (`entered` tells that the store worker is in it)."""

    def __init__(self):
        super().__init__(1 << 20)
        self.entered, self.gate = threading.Event(), threading.Event()

    def put(self, items, private=frozenset()):
        self.entered.set()
        assert self.gate.wait(30)
        return super().put(items)
