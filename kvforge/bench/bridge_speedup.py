"""Decode and prefill speed through the layer bridge against the per-operator forward of the same model, on
llama-batched-bench's shapes (`kvforge bench llama-cpp`'s rounds: `pl` random prompts of `npp` tokens prefilled
together, then `ntg` decode steps), in one run:
`python -m kvforge.bench.bridge_speedup [--model gemma3-270m] [--npl 1 8 32] [--npp 128] [--ntg 64] [--rounds 3]`.

Both sides run the same loaded model, each in its own engine; every round runs each batch size on both sides,
alternating which goes first, so a shared machine's load slows both alike. `ratio.*` = bridged / per-op tok/s
(wall clock), `ratio_cpu.*` the same per second of this thread's CPU time (steadier where other jobs share the cores;
meaningful at one thread).
"""
from __future__ import annotations

import argparse
import json

import torch

from kvforge.bench.llama_cpp import KvforgeRunner, _ratios, _totals, measure
from kvforge.bench.timing import Timing
from kvforge.errors import ConfigError
from kvforge.models.bridged import bridged_rows


class PathRunner:
    """KvforgeRunner with the model's layer bridge on or off for its rounds (the family's `use_bridge`)."""

    def __init__(self, loaded, npp: int, ntg: int, most: int, bridge: bool):
        self.family, self.bridge = type(loaded.model), bridge
        self.inner = KvforgeRunner(loaded, npp, ntg, most)

    def round(self, prompts: list[list[int]], ntg: int) -> Timing:
        saved = self.family.use_bridge
        self.family.use_bridge = self.bridge
        try:
            return self.inner.round(prompts, ntg)
        finally:
            self.family.use_bridge = saved

    def close(self) -> None:
        self.inner.close()


def bridge_speedup(loaded, npp: int = 128, ntg: int = 64, npl: tuple[int, ...] = (1, 8, 32), rounds: int = 3,
                   seed: int = 0) -> dict:
    if bridged_rows(loaded.model, 1) is None:
        raise ConfigError(f"the layer bridge does not serve {loaded.config.arch} here (kernels not built, or its "
                          f"layers are not a shape the bridge computes): nothing to compare")
    npl = list(npl)
    runners = {"bridged": PathRunner(loaded, npp, ntg, max(npl), True),
               "per_op": PathRunner(loaded, npp, ntg, max(npl), False)}
    rows = measure(runners, npp, ntg, npl, rounds, loaded.config.vocab_size, seed)
    result = {"model": loaded.config.arch, "npp": npp, "ntg": ntg, "npl": npl, "threads": torch.get_num_threads(),
              "rounds": rounds, **{side: {**r, **_totals(r, npp, ntg)} for side, r in rows.items()}}
    result["ratio"] = _ratios(result["bridged"], result["per_op"], npl, "tok_s")
    result["ratio_cpu"] = _ratios(result["bridged"], result["per_op"], npl, "tok_per_cpu_s")
    return result


def main() -> None:
    from kvforge.models.loader import load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--npp", type=int, default=128)
    p.add_argument("--ntg", type=int, default=64)
    p.add_argument("--npl", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    print(json.dumps(bridge_speedup(load_model(a.model), a.npp, a.ntg, tuple(a.npl), a.rounds), indent=2))


if __name__ == "__main__":
    main()
