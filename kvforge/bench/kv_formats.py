"""KV formats side by side: bytes per token, how many 2k-token sequences fit one budget, decode speed.

Decode speed is measured at a fixed context with the cache filled by the format's own write path
(random K/V rows, so no prefill is needed: attention reads the same bytes whatever they hold).
"""
from __future__ import annotations

import time

import torch

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.engine.sequence import SequenceStatus
from kvforge.kv.formats import KVFormat, get_format
from kvforge.kv.memory import budget_for, bytes_per_token, side_bytes
from kvforge.kv.spec import KVCacheSpec
from kvforge.sampling_params import SamplingParams


def sequences_that_fit(spec: KVCacheSpec, fmt: KVFormat, block_size: int, budget: int, seq_len: int) -> int:
    n = 0
    while budget_for(spec, fmt, block_size, seq_len, n + 1) <= budget:
        n += 1
    return n


@torch.inference_mode()
def fill_synthetic(engine: LLMEngine, context: int, batch: int, seed: int = 0) -> None:
    """Admit `batch` requests whose first context-1 tokens are already in the cache (random K/V)."""
    gen = torch.Generator().manual_seed(seed)
    spec, kv = engine.spec, engine.kv
    for b in range(batch):
        prompt = torch.randint(100, engine.model_config.vocab_size, (context,), generator=gen).tolist()
        rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True))
        seq = engine.requests[rid]
        engine.scheduler.waiting.remove(seq)
        kv.allocate_slots(seq, context - 1)
        slots = torch.tensor(kv.slots(seq, 0, context - 1), device=engine.device)
        positions = torch.arange(context - 1, device=engine.device)
        for layer in kv.pool.layers:
            k = torch.randn(context - 1, spec.num_kv_heads, spec.head_dim, generator=gen).to(engine.device)
            v = torch.randn(context - 1, spec.num_kv_heads, spec.v_head_dim, generator=gen).to(engine.device) \
                if spec.has_values else None
            layer.write(slots, k, v, positions)
        seq.num_computed_tokens = context - 1
        seq.status = SequenceStatus.RUNNING
        engine.scheduler.running.append(seq)


def decode_tok_s(loaded, dtype: str, context: int, batch: int, steps: int, block_size: int) -> float:
    engine = LLMEngine(EngineConfig(kv_cache_dtype=dtype, block_size=block_size, max_num_seqs=batch,
                                    kv_cache_memory=_budget_for(loaded, dtype, block_size, context + steps + 8, batch),
                                    max_model_len=context + steps + 8, enable_prefix_caching=False), loaded)
    fill_synthetic(engine, context, batch)
    engine.step()  # the last prompt token: first decode-shaped step, warms up
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return batch * steps / (time.perf_counter() - start)


def _budget_for(loaded, dtype: str, block_size: int, tokens: int, batch: int) -> int:
    return budget_for(KVCacheSpec.from_model_config(loaded.config), get_format(dtype), block_size, tokens, batch, 1)


def kv_formats_bench(loaded, formats: list[str] | None = None, budget: int = 1 << 30, seq_len: int = 2048,
                     batch: int = 4, steps: int = 16, block_size: int = 16) -> dict:
    spec = KVCacheSpec.from_model_config(loaded.config)
    formats = formats or list(KVFormat.registry)
    rows = {}
    for name in formats:
        fmt = get_format(name)
        rows[name] = {
            "bytes_per_token": bytes_per_token(spec, fmt, block_size),
            "side_bytes_per_seq": side_bytes(spec, fmt, block_size, 1),
            "sequences_fit": sequences_that_fit(spec, fmt, block_size, budget, seq_len),
        }
    base16 = rows.get("fp16", {}).get("sequences_fit") or sequences_that_fit(spec, get_format("fp16"), block_size, budget, seq_len)
    speed = {name: decode_tok_s(loaded, name, seq_len, batch, steps, block_size) for name in ["fp32"] + formats}
    for name, row in rows.items():
        row["capacity_ratio_vs_fp16"] = row["sequences_fit"] / base16
        row["decode_tok_s"] = speed[name]
        row["decode_slowdown_vs_fp32"] = 1 - speed[name] / speed["fp32"]
    return {"budget_bytes": budget, "seq_len": seq_len, "batch": batch, "decode_steps": steps,
            "threads": torch.get_num_threads(), "formats": rows}
