"""Prefix reuse across processes through a KV tier (`kvforge bench prefix --kv-tiers disk|redis|SPEC`).

The shared-prompt workload of kvforge.bench.prefix runs in one process with the tier attached (its KV blocks and,
on a recurrent model, its state checkpoints go there), then in a second process, a fresh engine on the same tier,
which reuses them: its hit rate is of the prompt tokens it could find cached (whole blocks, one token left to
compute), and its outputs are compared with the first process's and with caching off.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile

from kvforge.bench.prefix_workload import run_requests, shared_prompt_config, shared_prompts
from kvforge.errors import ConfigError


def _pass(model_path: str, tier: str, num_requests: int, system_len: int, question_len, max_tokens: int, budget: int,
          seed: int, show: bool, max_num_seqs: int, checkpoint_memory: int | None, label: str) -> dict:
    """One process's run of the workload through `tier` (what the child process prints)."""
    from kvforge.engine.engine import LLMEngine
    from kvforge.models.loader import load_model

    loaded = load_model(model_path)
    prompts = shared_prompts(loaded.config.vocab_size, num_requests, system_len, tuple(question_len), seed)
    engine = LLMEngine(shared_prompt_config(True, system_len, tuple(question_len), max_tokens, budget, max_num_seqs,
                                            checkpoint_memory, kv_tiers=[tier]), loaded)
    stats, outs = run_requests(engine, prompts, max_tokens, label, show)
    bs = engine.kv.block_size
    kv = engine.stats()
    engine.close()
    stats["cacheable_tokens"] = sum((len(p) - 1) // bs * bs for p in prompts)
    stats["outputs"] = [o.token_ids for o in outs.values()]
    stats.update({k: v for k, v in kv.items() if k.startswith(("state_checkpoints", "prefix_hits_short", "tier_"))
                  and not isinstance(v, list)})
    return stats


def _child(model_path: str, tier: str, args: tuple, label: str) -> dict:
    payload = json.dumps([model_path, tier, *args, label])
    done = subprocess.run([sys.executable, "-m", "kvforge.bench.prefix_tiers", payload], check=False,
                          stdout=subprocess.PIPE, text=True)  # its progress and errors go to this stderr
    if done.returncode:
        raise RuntimeError(f"the {label} process failed with exit status {done.returncode} (its stderr is above)")
    return json.loads(done.stdout.strip().splitlines()[-1])


def tier_scenario(model_path: str | None, tier: str, off_outputs: list[list[int]], num_requests: int, system_len: int,
                  question_len, max_tokens: int, budget: int, seed: int, show: bool, max_num_seqs: int = 64,
                  checkpoint_memory: int | None = None) -> dict:
    """`tier`: 'disk' (a fresh directory), 'redis' (a private redis-server), or a tier string (disk:PATH:SIZE,
    redis://HOST:PORT) another process may read."""
    if model_path is None:
        raise ConfigError("--kv-tiers needs --model DIR (the processes that share the tier load it)")
    args = (num_requests, system_len, list(question_len), max_tokens, budget, seed, show, max_num_seqs,
            checkpoint_memory)
    with tempfile.TemporaryDirectory(prefix="kvforge-prefix-tier-") as scratch:
        server = None
        if tier == "disk":
            spec = f"disk:{scratch}:{max(4 * budget, 1 << 30)}"
        elif tier == "redis":
            from kvforge.kv.tiers.local_redis import LocalRedis

            server = LocalRedis(scratch)
            spec = server.url
        elif tier.startswith(("disk:", "redis://")):
            spec = tier
        else:
            raise ConfigError(f"--kv-tiers {tier!r}: a tier another process can read: 'disk', 'redis', "
                              "disk:PATH:SIZE or redis://HOST:PORT")
        try:
            first = _child(model_path, spec, args, "through the tier, first process")
            second = _child(model_path, spec, args, "through the tier, second process")
        finally:
            if server is not None:
                server.stop()
    outputs = [first.pop("outputs"), second.pop("outputs")]
    return {
        "tier": tier if tier in ("disk", "redis") else spec,
        "first": first,
        "second": second,
        "second_hit_rate": second["hit_tokens"] / second["cacheable_tokens"] if second["cacheable_tokens"] else 0.0,
        "outputs_identical": outputs[0] == outputs[1] == off_outputs,
        "second_ttft_vs_first": second["ttft_mean_s"] / first["ttft_mean_s"],
    }


if __name__ == "__main__":
    model, tier_spec, *rest, label = json.loads(sys.argv[1])
    print(json.dumps(_pass(model, tier_spec, *rest, label)))
