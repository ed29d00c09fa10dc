"""`kvforge bench memory --model DIR --vs-attention`: a recurrent hybrid vs its all-attention twin under one budget
(kvforge.bench.recurrent_memory)."""
from __future__ import annotations

from kvforge.errors import ConfigError


def run_vs_attention(args, emit) -> int:
    from kvforge.bench.recurrent_memory import run_with_twin
    from kvforge.bench.recurrent_model import is_random

    if not args.model:
        raise ConfigError("--vs-attention needs --model DIR, a hybrid model directory (e.g. written by "
                          "python -m kvforge.bench.recurrent_model DIR)")
    r = run_with_twin(args.model, seq_len=args.twin_seq_len, budget_seqs=args.twin_budget_seqs, chunk=args.twin_chunk,
                      seed=args.seed, show_progress=not args.no_progress)
    r["random_weights"] = is_random(args.model)
    h, a = r["hybrid"], r["attention"]
    emit(r, args.json, [
        ("weights", "RANDOM (kvforge.bench.recurrent_model): engine figures only" if r["random_weights"] else None),
        ("layers: attention in the hybrid / all", f'{r["layers_attention"]} / {r["layers"]}'),
        ("KV budget (MiB)", f'{r["budget_bytes"] / 2**20:.1f}'),
        ("bytes per sequence, hybrid / attention", f'{h["bytes_per_sequence"]:,} / {a["bytes_per_sequence"]:,}'),
        (f'{r["seq_len"]}-token sequences that fit, hybrid / attention (formula)',
         f'{h["sequences_that_fit"]} / {a["sequences_that_fit"]}'),
        ("peak sequences decoding at once, hybrid / attention", f'{h["peak_decoding_seqs"]} / {a["peak_decoding_seqs"]}'),
        ("ratio: formula / measured", f'{r["formula_ratio"]:.3f} / {r["measured_ratio"]:.3f}'),
        ("measured / formula", r["measured_vs_formula"]),
        ("bytes-per-sequence ratio (no rounding)", r["bytes_ratio"]),
    ])
    return 0
