"""Recurrent hybrid memory: how many long sequences one KV budget holds for a hybrid (a few attention layers, the
rest Mamba-2 mixers with a constant state per sequence) and for its all-attention twin (the same config.json
with every layer attention: same width and depth, random weights).

The budget is room for `budget_seqs` twin sequences of `seq_len` tokens. For each model: the formula's count
(`sequences_that_fit`, state slots included) and the engine's measured peak of sequences decoding at once (each
holding its whole prompt), on a workload of a few more sequences than the formula fits. Outputs are long enough
that the first sequence still decodes when the last is prefilled, so the peak is bounded by memory.
"""
from __future__ import annotations

import json
import math
import random
import tempfile
from pathlib import Path

from kvforge.bench.layout_run import run_layout
from kvforge.bench.workload import Request, random_tokens
from kvforge.errors import ConfigError
from kvforge.kv.formats import get_format
from kvforge.kv.groups import build_groups, state_bytes_per_sequence
from kvforge.kv.memory import budget_for, bytes_per_token, sequences_that_fit


def attention_twin_config(config: dict) -> dict:
    """The hybrid's config.json with every layer attention (Granite 4.0-H / Bamba layout: `layer_types`)."""
    kinds = config.get("layer_types")
    if not kinds or "mamba" not in kinds:
        raise ConfigError("the recurrent memory comparison needs a hybrid config.json with layer_types naming "
                          "'mamba' layers (GraniteMoeHybridForCausalLM, e.g. python -m kvforge.bench.recurrent_model)")
    return dict(config, layer_types=["full_attention"] * len(kinds))


def write_attention_twin(directory: str | Path, out: str | Path) -> Path:
    from kvforge.bench.recurrent_model import write_recurrent_model

    config = json.loads((Path(directory) / "config.json").read_text())
    return write_recurrent_model(out, config=attention_twin_config(config))


def _fits(loaded, fmt, block_size: int, budget: int, seq_len: int) -> int:
    cfg = loaded.config
    return sequences_that_fit(cfg.kv_cache_spec(), fmt, block_size, budget, seq_len, build_groups(cfg.layer_windows()),
                              state_bytes_per_sequence(cfg.state_groups))


def recurrent_memory_bench(loaded, twin, seq_len: int = 8192, budget_seqs: int = 2, block_size: int = 16,
                           kv_dtype: str = "fp32", chunk: int = 2048, seed: int = 0, show_progress: bool = True) -> dict:
    """`loaded`: the hybrid; `twin`: its all-attention twin (write_attention_twin), both loaded."""
    fmt = get_format(kv_dtype)
    spec = twin.config.kv_cache_spec()
    budget = budget_for(spec, fmt, block_size, seq_len, budget_seqs, groups=build_groups(twin.config.layer_windows()))
    fits = {name: _fits(m, fmt, block_size, budget, seq_len) for name, m in (("hybrid", loaded), ("attention", twin))}
    num_requests = max(fits.values()) + 2
    output_len = math.ceil(num_requests * seq_len / chunk) + 16  # the first still decodes after the last prefill
    rng = random.Random(seed)
    workload = [Request(random_tokens(rng, seq_len - output_len, loaded.config.vocab_size), output_len)
                for _ in range(num_requests)]
    runs = {}
    for name, model in (("hybrid", loaded), ("attention", twin)):
        # prefix caching off: no checkpoint share is taken from the budget, as the formula counts
        runs[name] = run_layout(model, "paged", workload, budget, seq_len, num_requests, show_progress, name,
                                block_size=block_size, kv_cache_dtype=kv_dtype, max_num_batched_tokens=chunk)
        runs[name].pop("utilization")
        runs[name]["sequences_that_fit"] = fits[name]
        runs[name]["state_bytes_per_sequence"] = state_bytes_per_sequence(model.config.state_groups)
        runs[name]["kv_bytes_per_token"] = bytes_per_token(model.config.kv_cache_spec(), fmt, block_size)
        runs[name]["bytes_per_sequence"] = budget_for(
            model.config.kv_cache_spec(), fmt, block_size, seq_len, groups=build_groups(model.config.layer_windows()),
            state_bytes=runs[name]["state_bytes_per_sequence"])
    h, a = runs["hybrid"], runs["attention"]
    measured = h["peak_decoding_seqs"] / max(1, a["peak_decoding_seqs"])
    formula = h["sequences_that_fit"] / max(1, a["sequences_that_fit"])
    return {
        "seq_len": seq_len,
        "budget_bytes": budget,
        "num_requests": num_requests,
        "output_len": output_len,
        "layers_attention": loaded.config.kv_cache_spec().num_layers,
        "layers": twin.config.kv_cache_spec().num_layers,
        **runs,
        "formula_ratio": formula,
        "measured_ratio": measured,
        "measured_vs_formula": measured / formula if formula else 0.0,
        "bytes_ratio": a["bytes_per_sequence"] / h["bytes_per_sequence"],  # the formula before whole sequences
    }


def run_with_twin(directory: str, **options) -> dict:
    """Load the hybrid at `directory`, write and load its all-attention twin in a temporary directory, compare."""
    from kvforge.models.loader import load_model

    with tempfile.TemporaryDirectory(prefix="kvforge-twin-") as tmp:
        twin = load_model(str(write_attention_twin(directory, tmp)))
        return recurrent_memory_bench(load_model(directory), twin, **options)
