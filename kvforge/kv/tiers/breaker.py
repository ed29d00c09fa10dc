"""CircuitBreaker: after repeated failures of a tier, skip it for a back-off period instead of calling it.

Closed: every call goes through; `failures_to_open` consecutive failures open it, and so does one failure that took
`slow_call_s` or more (a timeout: the server hangs, and every call would wait as long). Open: calls
are skipped (read as misses, stores dropped) until the back-off has passed; then one call goes through as a probe
(half-open). A probe that succeeds closes the breaker; one that fails opens it again with twice the back-off, up
to `max_backoff_s`. Thread-safe: the engine thread and the tier workers share one breaker per tier.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

FAILURES_TO_OPEN = 3
SLOW_CALL_S = 0.25  # a failure this slow opens at once; a lookup or load in flight this long is suspect
BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


class CircuitBreaker:
    def __init__(self, failures_to_open: int = FAILURES_TO_OPEN, backoff_s: float = BACKOFF_S,
                 max_backoff_s: float = MAX_BACKOFF_S, slow_call_s: float = SLOW_CALL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.failures_to_open, self.backoff_s, self.max_backoff_s = failures_to_open, backoff_s, max_backoff_s
        self.slow_call_s = slow_call_s
        self.clock = clock
        self.failures = 0  # consecutive
        self.trips = 0  # times it opened
        self.next_backoff_s = backoff_s
        self.open_until: float | None = None  # None: closed
        self._probing = False
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return self.open_until is not None

    def would_allow(self) -> bool:
        """Whether a call now would go through (no state change)."""
        with self._lock:
            return self.open_until is None or (not self._probing and self.clock() >= self.open_until)

    def allow(self) -> bool:
        """Whether to make the call; when the back-off has passed, the first caller gets through as the probe."""
        with self._lock:
            if self.open_until is None:
                return True
            if self._probing or self.clock() < self.open_until:
                return False
            self._probing = True
            return True

    def succeeded(self) -> None:
        with self._lock:
            self.failures, self.open_until, self._probing = 0, None, False
            self.next_backoff_s = self.backoff_s

    def failed(self, seconds: float = 0.0) -> None:
        """A call failed after `seconds`."""
        with self._lock:
            self.failures += 1
            enough = self.failures >= self.failures_to_open or seconds >= self.slow_call_s
            if self._probing or (self.open_until is None and enough):
                self.trips += 1
                self.open_until = self.clock() + self.next_backoff_s
                self.next_backoff_s = min(2 * self.next_backoff_s, self.max_backoff_s)
                self._probing = False
