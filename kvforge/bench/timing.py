"""Wall and thread-CPU time of a benchmark phase. At one thread both engines compute on the calling thread,
so its CPU time is the work done, which other processes on a shared machine inflate far less than wall time."""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    wall: float
    cpu: float


@dataclass(frozen=True)
class Timing:
    prefill: Span
    decode: Span


class Clock:
    def __init__(self):
        self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def split(self) -> Span:
        """The time since the last split (or since the clock started)."""
        wall, cpu = time.perf_counter(), time.thread_time()
        span = Span(wall - self._wall, cpu - self._cpu)
        self._wall, self._cpu = wall, cpu
        return span
