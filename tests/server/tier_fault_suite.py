"""The tier fault run: several `kvforge serve` processes (two tiny models that differ only in rope_theta, several KV
formats and weights modes, write-through or write-back, both tier orders) share one Redis and one disk directory
(tier_cluster.py) while they are restarted with SIGTERM and SIGKILL, Redis is paused, killed and restarted, stray
and corrupt files land in the directory, and clients send greedy, abandoned and bad requests, with and without a
cache salt. Every greedy answer is compared with the same model, format and weights run without tiers in this
process. test_tier_faults.py asserts on a small run; `python tests/server/tier_fault_suite.py [--full] [SEED]`
prints the Report as JSON."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from fault_suite import BAD as SERVER_BAD
from fault_suite import Job, Result
from faults import write_tiny_char_model
from tier_cluster import ENGINE_OPTIONS, STRAY, DiskWatch, EngineProcess, EngineSpec, SharedRedis, corrupt_some

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.llm import LLM
from kvforge.models.loader import load_model
from kvforge.sampling_params import SamplingParams

DEADLINE_S = 90  # per client; a request still open after it counts as hung
PHASES = ("redis up", "redis paused", "redis killed", "redis restarted")
PREFIXES = ("You are a terse assistant. Reply in one line. ", "Summarise the text below for a busy reader. ",
            "Translate into plain English and keep it short. ")
BAD = {name: SERVER_BAD[name] for name in ("n=0", "logprobs=21", "token id 999", "empty prompt")} | {
    "repetition_penalty=1e-39": ({"repetition_penalty": 1e-39}, "repetition_penalty"),
    "seed=2**64": ({"seed": 2**64}, "seed"), "seed=-2**63-1": ({"seed": -2**63 - 1}, "seed")}
STEP = "kvforge_engine_step_seconds"
BLOCK = 16  # the engines' block size, in tokens (= characters of the tiny char model)


@dataclass(frozen=True)
class SuiteConfig:
    engines: tuple[EngineSpec, ...]
    clients: int
    restarts: int  # engine restarts, SIGTERM and SIGKILL in turn, spread over the phases after Redis was paused
    disk_budget: int = 96 << 10  # every engine's disk tier budget, in bytes


# model a's engine stores each block in Redis as soon as it is computed; b's engine asks Redis for the same prompts
SMALL = SuiteConfig((EngineSpec("a", write_through=True, redis_first=True), EngineSpec("b")), 24, 1)
FULL = SuiteConfig((EngineSpec("a", write_through=True, redis_first=True), EngineSpec("a"),  # the same model twice
                    EngineSpec("a", weights="int8", redis_first=True),
                    EngineSpec("b"), EngineSpec("b", "int8", write_through=True), EngineSpec("a", "fp16", redis_first=True),
                    EngineSpec("a", "bf16", write_through=True), EngineSpec("a", tiers=False)), 64, 6, 192 << 10)


@dataclass
class TierJob(Job):
    engine: int = 0
    salt: str | None = None
    phase: int = 0


@dataclass
class Report:
    requests: int = 0
    completed: int = 0
    compared_greedy: int = 0
    wrong_outputs: int = 0
    wrong_tokens: int = 0  # from each wrong output's first differing token on
    greedy_batch_dependent: int = 0  # compared outputs whose tierless reference differs batched and alone
    good_requests_failed: int = 0  # errors on an engine that was not being restarted: another's input, a tier fault
    interrupted_by_restart: int = 0
    disconnected: int = 0
    hung: int = 0
    bad_inputs_400: int = 0
    bad_inputs_not_400: int = 0
    engine_restarts: int = 0
    engine_crashes: int = 0
    max_step_s_redis_paused: float = 0.0  # longest step of a tiered engine while Redis was paused
    max_step_s_redis_up: float = 0.0  # and while Redis was up (the same engines, the first phase's traffic)
    mean_step_s_redis_paused: float = 0.0  # the highest of the tiered engines' mean steps
    max_step_s_without_tiers: float | None = None  # the control engine's, same phase (when there is one)
    disk_budget_bytes: int = 0
    disk_bytes_max: int = 0  # the tier files in the shared directory, sampled every 0.1 s
    tier_hit_tokens: int = 0  # prompt tokens loaded from the tiers (lost with a SIGKILLed process)
    leaked_blocks: int = 0  # after the run and a prefix-cache reset
    leaked_request_states: int = 0
    tree_nodes_after_reset: int = 0
    failures: list[str] = field(default_factory=list)  # what went wrong, a sample

    def counts(self) -> dict:
        return asdict(self)


def plan(config: SuiteConfig, seed: int) -> list[TierJob]:
    """Job i runs in phase i % 4 on engine i // 4 % n; the n jobs of a phase in each run of 4n share prompt and salt,
    so every engine asks for what the one before it computed (engine k starts k seconds into the phase)."""
    rng, n = random.Random(seed), len(config.engines)
    prompts = [p + f"Q{k}: " + "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(3, 12)))
               for k, p in enumerate(PREFIXES * 4)]
    asks = [(rng.choice(prompts), rng.choice((None, None, "tenant-1"))) for _ in range(config.clients)]
    kinds = (["stream"] * 7 + ["plain"] * 3 + ["quit"] * 2 + ["bad"] * 3) * (config.clients // 15 + 1)
    kinds = kinds[:config.clients]
    rng.shuffle(kinds)
    bad = [name for name in BAD] * config.clients
    jobs = []
    for i, kind in enumerate(kinds):
        prompt, salt = asks[i % 4 + i // (4 * n) * 4]
        jobs.append(TierJob(i, kind, prompt, rng.choice((16, 24, 32)), rng.randint(1, 4), bad[i] if kind == "bad" else "",
                            engine=i // 4 % n, salt=salt, phase=i % 4))
    return jobs


def write_models(directory: Path) -> dict[str, str]:
    """Model a, and model b: a's weights with another rope_theta (a config change that changes every K). Queries
    are scaled up in both, so attention is sharp and outputs depend on positions: K/V of the other model shows."""
    from safetensors.torch import load_file, save_file

    dirs = {"a": directory / "model-a", "b": directory / "model-b"}
    for d in dirs.values():
        write_tiny_char_model(d)
        weights = load_file(d / "model.safetensors")
        save_file({k: v * 8 if "q_proj" in k else v for k, v in weights.items()}, d / "model.safetensors",
                  metadata={"format": "pt"})
    config = json.loads((dirs["b"] / "config.json").read_text())
    config.setdefault("rope_parameters", {})["rope_theta"] = 20.0
    config["rope_theta"] = 20.0
    (dirs["b"] / "config.json").write_text(json.dumps(config))
    return {k: str(v) for k, v in dirs.items()}


def references(config: SuiteConfig, jobs: list[TierJob], models: dict[str, str]) -> dict[tuple, set[tuple[str, str]]]:
    """(model, kv dtype, weights, prompt, max_tokens) -> the greedy (text, finish_reason) without tiers, run in one
    batch, one at a time, and after each whole-block head of the prompt was cached: a server batches requests as
    they come and a tier hit leaves fewer prompt tokens to compute, and some engines' numerics (int8 weights: up to
    16 rows round activations to 8 bits) depend on the rows of a step, so any of these answers is right; a block
    read from a tier must give what the same cached prefix gives without tiers."""
    expected: dict[tuple, set[tuple[str, str]]] = {}
    for ref in sorted({s.reference for s in config.engines}):
        model, kv_dtype, weights = ref
        asks = sorted({(j.prompt, j.max_tokens) for j in jobs if j.kind != "bad" and config.engines[j.engine].reference == ref})
        llm = LLM.from_engine(LLMEngine(EngineConfig(**ENGINE_OPTIONS, kv_cache_dtype=kv_dtype, weights=weights),
                                        load_model(models[model])))
        params = [SamplingParams(temperature=0, max_tokens=m) for _, m in asks]
        batched = llm.generate([p for p, _ in asks], params)
        alone = [llm.generate([p], [sp])[0] for (p, _), sp in zip(asks, params)]
        expected |= {(*ref, *a): {(b.text, b.finish_reason), (o.text, o.finish_reason)}
                     for a, b, o in zip(asks, batched, alone)}
        for (p, m), sp in zip(asks, params):
            for head in range(BLOCK, len(p), BLOCK):
                llm.engine.kv.reset_prefix_cache()
                llm.generate([p[:head]], [SamplingParams(temperature=0, max_tokens=1)])
                o = llm.generate([p], [sp])[0]
                expected[(*ref, p, m)].add((o.text, o.finish_reason))
    return expected


async def ask(client: httpx.AsyncClient, engine: EngineProcess, job: TierJob) -> Result:
    while engine.restarting:  # a client retries a server that is down; one cut off mid-request counts below
        await asyncio.sleep(0.05)
    start = time.monotonic()
    # a temperature below 1e-5 is greedy (as in vLLM): such requests are compared with the greedy reference too
    body = {"model": "m", "prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": 0 if job.index % 4 else 1e-39}
    if job.salt:
        body["cache_salt"] = job.salt
    try:
        result = await (stream if job.kind in ("stream", "quit") else plain)(client, engine.url, body, job)
    except httpx.TransportError as e:
        result = Result(job, "error", message=f"{type(e).__name__}: {e}")
    if result.outcome == "error" and engine.down_during(start, time.monotonic()):
        result.outcome = "interrupted"
    return result


async def plain(client: httpx.AsyncClient, url: str, body: dict, job: TierJob) -> Result:
    r = await client.post(url + "/v1/completions", json=body | (BAD[job.bad][0] if job.kind == "bad" else {}))
    if job.kind == "bad":
        return Result(job, "bad" if r.status_code == 400 else "accepted", status=r.status_code, message=r.text[:300])
    if r.status_code != 200:
        return Result(job, "error", status=r.status_code, message=r.text[:300])
    choice = r.json()["choices"][0]
    return Result(job, "ok", [choice["text"]], [choice["finish_reason"]], 200)


async def stream(client: httpx.AsyncClient, url: str, body: dict, job: TierJob) -> Result:
    async with client.stream("POST", url + "/v1/completions", json=body | {"stream": True}) as r:
        if r.status_code != 200:
            return Result(job, "error", status=r.status_code, message=(await r.aread()).decode()[:300])
        text, reason, chunks = "", None, 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Result(job, "error", status=200, message=json.dumps(chunk["error"])[:300])
            if job.kind == "quit" and chunks >= job.quit_after:
                return Result(job, "quit")  # leaving the block hangs up
            chunks += 1
            text += chunk["choices"][0]["text"]
            reason = chunk["choices"][0].get("finish_reason") or reason
    if reason is None:
        return Result(job, "error", status=200, message="the stream ended without a finish_reason")
    return Result(job, "ok", [text], [reason], 200)


async def run_phase(jobs: list[TierJob], engines: list[EngineProcess], chaos, rng: random.Random) -> list[Result]:
    """The phase's clients, staggered, with `chaos` (restarts, in a thread) running beside them."""
    async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
        async def one(job: TierJob) -> Result:
            await asyncio.sleep(job.engine + rng.random())  # engine 0 computes first: the others may reuse
            try:
                return await asyncio.wait_for(ask(client, engines[job.engine], job), DEADLINE_S)
            except asyncio.TimeoutError:
                return Result(job, "hung")

        *results, _ = await asyncio.gather(*(one(j) for j in jobs), asyncio.to_thread(chaos))
    return results


def step_during(before: dict, after: dict) -> tuple[float, float]:
    """(longest, mean) step between two /metrics samples: the max gauge when it grew, else the smallest histogram
    bound holding every step of the interval."""
    steps = after[f"{STEP}_count"] - before.get(f"{STEP}_count", 0)
    if steps == 0:
        return 0.0, 0.0
    mean = (after[f"{STEP}_sum"] - before.get(f"{STEP}_sum", 0)) / steps
    if after[f"{STEP}_max"] > before.get(f"{STEP}_max", 0):
        return after[f"{STEP}_max"], mean
    bounds = sorted(float(k.split('"')[1]) for k in after if k.startswith(f'{STEP}_bucket{{le="') and "Inf" not in k)
    held = [b for b in bounds if after[f'{STEP}_bucket{{le="{b}"}}'] - before.get(f'{STEP}_bucket{{le="{b}"}}', 0) == steps]
    return (held[0] if held else after[f"{STEP}_max"]), mean


def settle(engine: EngineProcess) -> dict[str, float]:
    """Wait until the engine holds no request, reset its prefix cache, and return its /metrics."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        m = engine.metrics()
        if sum(m.get(f"kvforge_requests_{k}", 0) for k in ("running", "waiting", "loading")) == 0:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"engine {engine.spec} still has requests after {DEADLINE_S} s")
        time.sleep(0.1)
    httpx.post(engine.url + "/reset_prefix_cache", timeout=DEADLINE_S).raise_for_status()
    return engine.metrics()


def paused_phase(jobs: list[TierJob], engines: list[EngineProcess], redis: SharedRedis, report: Report,
                 rng: random.Random) -> list[Result]:
    """Clients run while Redis is stopped (SIGSTOP: connections hang, nothing is refused); steps are timed."""
    before = [e.metrics() for e in engines]
    redis.pause()
    try:
        results = asyncio.run(run_phase(jobs, engines, lambda: None, rng))
    finally:
        redis.resume()
    steps = [step_during(b, e.metrics()) for b, e in zip(before, engines)]
    tiered = [s for s, e in zip(steps, engines) if e.spec.tiers]
    control = [s[0] for s, e in zip(steps, engines) if not e.spec.tiers]
    report.max_step_s_redis_paused = max(s[0] for s in tiered)
    report.mean_step_s_redis_paused = max(s[1] for s in tiered)
    report.max_step_s_without_tiers = max(control) if control else None
    return results


def run_tier_fault_suite(config: SuiteConfig = SMALL, seed: int = 0, workdir: str | None = None) -> Report:
    with tempfile.TemporaryDirectory() as tmp:
        return _run(config, seed, Path(workdir or tmp))


def _run(config: SuiteConfig, seed: int, work: Path) -> Report:
    rng, jobs = random.Random(seed), plan(config, seed)
    models = write_models(work)
    expected = references(config, jobs, models)
    disk, report = work / "disk-tier", Report(requests=len(jobs), disk_budget_bytes=config.disk_budget)
    disk.mkdir()
    redis = SharedRedis(str(work))
    tiers = {False: ["--kv-tier", f"disk:{disk}:{config.disk_budget}", "--kv-tier", redis.url]}
    tiers[True] = tiers[False][2:] + tiers[False][:2]
    engines = [EngineProcess(s, models[s.model], tiers[s.redis_first], str(work / f"engine-{i}.log"))
               for i, s in enumerate(config.engines)]
    tiered = [i for i, s in enumerate(config.engines) if s.tiers]
    restarts, chaos_rng = iter([signal.SIGTERM, signal.SIGKILL] * config.restarts), random.Random(seed + 1)
    per_phase = dict(zip((2, 3), (config.restarts // 2 + (k < config.restarts % 2) for k in range(2))))

    def chaos(count: int):
        def run():
            for _ in range(count):
                time.sleep(chaos_rng.uniform(0.3, 1.5))  # requests are in flight by then
                try:
                    engines[chaos_rng.choice(tiered)].restart(next(restarts))
                    report.engine_restarts += 1
                except RuntimeError as e:  # it did not come back
                    report.engine_crashes += 1
                    report.failures.append(str(e))
        return run

    results: list[Result] = []
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready()
        for name, data in STRAY.items():
            (disk / name).write_bytes(data)
        with DiskWatch(disk) as watch:
            for phase, name in enumerate(PHASES):
                phase_jobs = [j for j in jobs if j.phase == phase]
                if name == "redis paused":
                    results += paused_phase(phase_jobs, engines, redis, report, rng)
                    continue
                if name == "redis up":
                    before = [e.metrics() for e in engines]
                    results += asyncio.run(run_phase(phase_jobs, engines, lambda: None, rng))
                    report.max_step_s_redis_up = max(step_during(b, e.metrics())[0]
                                                     for b, e in zip(before, engines) if e.spec.tiers)
                    continue
                if name == "redis killed":
                    redis.kill()
                if name == "redis restarted":
                    redis.restart()
                    corrupt_some(disk, rng)
                results += asyncio.run(run_phase(phase_jobs, engines, chaos(per_phase[phase]), rng))
                for e in engines:
                    e.check_alive()
        report.disk_bytes_max = watch.max_bytes
        for e in engines:
            m = settle(e)
            report.leaked_blocks += int(m["kvforge_kv_blocks_used"])
            report.leaked_request_states += int(m["kvforge_kv_request_states"])
            report.tree_nodes_after_reset += int(m["kvforge_prefix_tree_nodes"])
            report.tier_hit_tokens += int(m.get("kvforge_kv_tier_prefix_hits_total", 0) + e.earlier_tier_hits)
            report.engine_crashes += e.crashes
    finally:
        for e in engines:
            e.stop()
        redis.stop()
    tally(report, results, config, expected)
    return report


def tally(report: Report, results: list[Result], config: SuiteConfig, expected: dict) -> None:
    for r in results:
        job = r.job
        report.completed += r.outcome == "ok"
        report.disconnected += r.outcome == "quit"
        report.hung += r.outcome == "hung"
        report.interrupted_by_restart += r.outcome == "interrupted"
        report.bad_inputs_400 += r.outcome == "bad"
        report.bad_inputs_not_400 += r.outcome == "accepted"
        if r.outcome == "accepted":
            report.failures.append(f"bad input {job.bad} got {r.status}: {r.message[:120]}")
        if r.outcome in ("error", "hung"):
            report.good_requests_failed += 1
            report.failures.append(f"{PHASES[job.phase]}, engine {job.engine}: {r.outcome} {r.status} {r.message[:160]}")
        if r.outcome == "ok":
            report.compared_greedy += 1
            wanted = expected[(*config.engines[job.engine].reference, job.prompt, job.max_tokens)]
            report.greedy_batch_dependent += len(wanted) > 1
            got_text = r.texts[0]
            if (got_text, r.reasons[0]) not in wanted:
                want_text = min(wanted)[0]
                report.wrong_outputs += 1
                same = next((i for i, (a, b) in enumerate(zip(got_text, want_text)) if a != b),
                            min(len(got_text), len(want_text)))
                report.wrong_tokens += max(len(got_text), len(want_text), same + 1) - same
                report.failures.append(f"wrong tokens, {PHASES[job.phase]}, engine {job.engine} "
                                       f"{config.engines[job.engine]}: {got_text!r} != {want_text!r}")
    report.failures = report.failures[:40]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: tiny_models
    args = sys.argv[1:]
    chosen = FULL if "--full" in args else SMALL
    seeds = [int(a) for a in args if a.lstrip("-").isdigit()]
    print(json.dumps(run_tier_fault_suite(chosen, seeds[0] if seeds else 0).counts(), indent=1))
