"""What issue 31's goals against llama.cpp need, from one command: `bench/llama_cpp.py`'s side-by-side rounds at
each thread count (prefill and decode of every batch size, ratios), the share of the measured copy bandwidth that
one-sequence decode reaches in each engine (`bench/bandwidth.py`), and the peak RSS of each engine in its own
fresh process at an equal KV capacity (`bench/kv_rss.py`)."""
from __future__ import annotations

from kvforge.bench.bandwidth import bandwidth_fraction, copy_bandwidth
from kvforge.bench.llama_cpp import llama_cpp_bench
from kvforge.errors import ConfigError

SIDES = ("kvforge", "llama_cpp")


def parse_threads(values: list[str]) -> list[int]:
    """`--threads 1,2`, `--threads 1 2`: thread counts, each >= 1, in the order given."""
    try:
        counts = [int(v) for value in values for v in str(value).split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--threads takes thread counts such as 1,2 or 1 2, got {' '.join(values)!r}") from None
    if not counts or min(counts) < 1:
        raise ConfigError(f"--threads takes thread counts >= 1, got {' '.join(values)!r}")
    return counts


def bandwidth_at_one_sequence(run: dict, copy_bytes_per_s: float) -> dict:
    """Each engine's one-sequence decode traffic (weight bytes per token x tok/s) over the copy bandwidth."""
    if 1 not in run["npl"]:
        return {}
    return {side: bandwidth_fraction(run[side]["weight_bytes_per_token"], run[side]["b1"]["decode_tok_s"],
                                     copy_bytes_per_s) for side in SIDES if side in run}


def llama_cpp_suite(loaded, threads: list[int], rss_tokens: int = 8192, gguf: str | None = None, **bench) -> dict:
    """`llama_cpp_bench` at every thread count with the bandwidth shares at one sequence, then (given a GGUF that
    both engines read, and llama.cpp) the RSS at an equal KV capacity of `rss_tokens` (0: not measured)."""
    runs, bandwidth = {}, {}
    for t in threads:
        run = llama_cpp_bench(loaded, threads=t, **bench)
        copy = copy_bandwidth(t)
        runs[str(t)] = run
        bandwidth[str(t)] = {"copy_bytes_per_s": copy, **bandwidth_at_one_sequence(run, copy)}
    result = {"threads": threads, "runs": runs, "bandwidth_b1": bandwidth}
    if rss_tokens and gguf and not bench.get("kvforge_only"):
        from kvforge.bench.kv_rss import equal_kv_rss

        result["rss_equal_kv"] = equal_kv_rss(gguf, rss_tokens, threads[0], bench.get("weights", "auto"),
                                              bench.get("llama_extra_bufts", True))
    return result


def summary_rows(r: dict) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = []
    for t, run in r["runs"].items():
        for side in SIDES:
            if side in run:
                rows.append((f"t{t} {side} prefill tok/s", run[side]["prefill_tok_s"]))
                rows += [(f"t{t} {side} decode tok/s, {pl} seqs", run[side][f"b{pl}"]["decode_tok_s"])
                         for pl in run["npl"]]
        rows += [(f"t{t} ratio.{k}", v) for k, v in run.get("ratio", {}).items()]
        rows += [(f"t{t} ratio_cpu.{k}", v) for k, v in run.get("ratio_cpu", {}).items()]
        bw = r["bandwidth_b1"][t]
        rows.append((f"t{t} copy bandwidth GB/s", bw["copy_bytes_per_s"] / 1e9))
        rows += [(f"t{t} {side} bandwidth share, 1 seq", bw[side]["fraction"]) for side in SIDES if side in bw]
    rss = r.get("rss_equal_kv")
    if rss:
        rows += [(f"{side} max RSS MiB, {rss['tokens']}-token fp16 KV", rss[side]["max_rss_mib"]) for side in SIDES]
        rows.append(("ratio max RSS kvforge / llama.cpp", rss["ratio_max_rss"]))
    return rows
