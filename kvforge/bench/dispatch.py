"""Count the aten operators a piece of engine work dispatches (each one is a trip through torch's
dispatcher and, on CPU, a small kernel launch): `count_ops(fn)` for any callable, `decode_step_ops`
for one decode step of an engine (`python -m kvforge.bench.dispatch [--batch 1 8] [--context 128] [--model M]`;
`per_op_*`: the same step without the layer bridge; any family with `use_bridge`, e.g. `--model gemma3-270m`), and the
median CPU time of this thread per decode step (`--time-steps N`; the file also runs as a script against
another checkout's kvforge on PYTHONPATH, for before/after comparisons in one run).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], object]) -> Counter[str]:
    """The operators fn dispatches, by name (e.g. `aten.mm`, `kvforge.paged_decode`), with their counts."""
    with _Counter() as counter:
        fn()
    return counter.ops


def decode_step_ops(engine) -> Counter[str]:
    """Operators of the engine's next step, after one warm-up step (first-use caches filled); for a decode step,
    give it an engine whose running sequences are all decoding (e.g. `bench.kv_formats.decode_engine`)."""
    engine.step()
    return count_ops(engine.step)


def step_cpu_ms(engine, steps: int) -> float:
    """Median CPU time of this thread (ms) per engine step, over `steps` steps."""
    times = []
    for _ in range(steps):
        start = time.thread_time()
        engine.step()
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e3


def dispatch_report(batches: list[int], context: int, model: str | None = None, time_steps: int = 0) -> dict:
    from kvforge.bench.kv_formats import decode_engine
    from kvforge.models.loader import load_model

    loaded = load_model(model)
    layers = loaded.config.num_layers
    rows = {}
    family = type(loaded.model)  # LlamaForCausalLM, GemmaForCausalLM: each has use_bridge
    saved = family.use_bridge
    for batch in batches:
        for path, bridge in (("", saved), ("per_op_", False)):  # the step as it runs, then without the layer bridge
            family.use_bridge = bridge
            try:
                engine = decode_engine(loaded, "fp32", context - 1, batch, 8 + time_steps, 16)
                ops = decode_step_ops(engine)
                total = sum(ops.values())
                row = rows.setdefault(f"b{batch}", {})
                row.update({f"{path}ops_per_step": total, f"{path}ops_per_layer": total / layers,
                            f"{path}top": dict(ops.most_common(12))})
                if time_steps:
                    row[f"{path}cpu_ms_per_step"] = step_cpu_ms(engine, time_steps)
            finally:
                family.use_bridge = saved
    return {"context": context, "layers": layers, "steps": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--model", default=None)
    p.add_argument("--time-steps", type=int, default=0, help="also time this many decode steps (CPU ms, median)")
    a = p.parse_args()
    print(json.dumps(dispatch_report(a.batch, a.context, a.model, a.time_steps), indent=2))


if __name__ == "__main__":
    main()
