"""What the tier fault run shares and breaks: `kvforge serve` engines, each restartable with SIGTERM or SIGKILL on its
own port, the Redis they share (paused, killed, restarted), and their disk directory (stray and corrupt files, its
size watched)."""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx

from kvforge.kv.tiers.local_redis import LocalRedis, free_port

STRAY = {"backup-2024.kvb": os.urandom(3000), "notes.txt": b"not a KV block\n"}  # foreign files in the tier's directory
READY_S = 180  # a cold start on a loaded machine (imports, load, packing) takes ~10 s, more when several start
ENGINE_OPTIONS = {"kv_cache_memory": 160 << 10, "max_model_len": 256, "max_num_seqs": 16}  # a small pool: blocks
ENGINE_ARGS = ["--kv-memory", "160KiB", "--max-model-len", "256", "--max-num-seqs", "16"]  # leave it for the tiers


@dataclass(frozen=True)
class EngineSpec:
    model: str  # "a", or "b": the same weights with another rope_theta
    kv_dtype: str = "fp32"
    weights: str = "fp32"
    write_through: bool = False
    redis_first: bool = False  # tier lookup order: redis then disk, else disk then redis
    tiers: bool = True  # False: the control engine, whose step time is the one without tiers

    @property
    def reference(self) -> tuple[str, str, str]:
        """What its greedy outputs must equal: the same model, KV format and weights run without tiers."""
        return self.model, self.kv_dtype, self.weights


@dataclass
class EngineProcess:
    spec: EngineSpec
    model_dir: str
    tier_args: list[str]
    log_path: str
    port: int = field(default_factory=free_port)
    restarts: list[tuple[float, float]] = field(default_factory=list)  # (signalled, ready again), monotonic
    restarting: bool = False
    crashes: int = 0  # exits nobody asked for
    earlier_tier_hits: float = 0  # tier hit tokens of its processes before the last restart
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        s = self.spec
        cmd = [sys.executable, "-m", "kvforge.cli", "serve", self.model_dir, "--port", str(self.port),
               "--served-model-name", "m", "--log-level", "warning", "--kv-dtype", s.kv_dtype, "--weights", s.weights,
               *ENGINE_ARGS]
        if s.tiers:
            cmd += self.tier_args + (["--kv-tier-write-through"] if s.write_through else [])
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.spec} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {self.spec} not ready after {READY_S} s; see {self.log_path}")
            time.sleep(0.1)

    def restart(self, sig: signal.Signals) -> None:
        """Signal the engine, wait for it to exit (SIGKILL after 30 s), start it again and wait until it serves."""
        self.restarting, signalled = True, time.monotonic()
        try:
            self.earlier_tier_hits += self.metrics().get("kvforge_kv_tier_prefix_hits_total", 0)
        except httpx.HTTPError:
            pass
        try:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.start()
            self.wait_ready()
        finally:
            self.restarts.append((signalled, time.monotonic()))
            self.restarting = False

    def down_during(self, start: float, end: float) -> bool:
        """Whether a restart overlapped [start, end] (a request then may fail: the process it talked to is gone)."""
        return self.restarting or any(s <= end and e >= start for s, e in self.restarts)

    def check_alive(self) -> None:
        if not self.restarting and self.proc.poll() is not None:
            self.crashes += 1
            self.start()
            self.wait_ready()

    def metrics(self) -> dict[str, float]:
        """/metrics as {sample name with labels: value}."""
        text = httpx.get(self.url + "/metrics", timeout=60).text
        return {name: float(value) for name, value in re.findall(r"^([^#\s]\S*) (\S+)$", text, re.MULTILINE)}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class SharedRedis:
    """The one Redis every engine's tier points at; killed and restarted on the same port (empty: no persistence)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.server = LocalRedis(directory)
        self.port, self.url = self.server.port, self.server.url

    def pause(self) -> None:
        os.kill(self.server.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.server.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        self.resume()
        self.server.stop()

    def restart(self) -> None:
        self.server = LocalRedis(self.directory, port=self.port)

    def stop(self) -> None:
        self.kill()


class DiskWatch:
    """Samples the bytes of the tier's files in the shared directory (not the stray files this run drops there)."""

    def __init__(self, directory: Path):
        self.directory, self.max_bytes, self._stop = directory, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.max_bytes = max(self.max_bytes, self.sample())

    def sample(self) -> int:
        total = 0
        for entry in os.scandir(self.directory):
            try:
                total += entry.stat().st_size if entry.name not in STRAY else 0
            except FileNotFoundError:  # removed while we looked
                pass
        return total

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.thread.join()
        self.max_bytes = max(self.max_bytes, self.sample())


def corrupt_some(directory: Path, rng: random.Random, count: int = 3) -> None:
    """Truncate one stored block file, flip a byte in the middle of others (what a crash or bad disk leaves)."""
    files = sorted(p for p in directory.glob("*.kvb") if p.name not in STRAY)
    for i, path in enumerate(rng.sample(files, min(count, len(files)))):
        try:
            data = bytearray(path.read_bytes())
            if i == 0:
                data = data[: len(data) // 2]
            else:
                data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        except FileNotFoundError:
            pass
