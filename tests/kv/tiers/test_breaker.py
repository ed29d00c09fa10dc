"""CircuitBreaker: consecutive or slow failures open it; one probe after the back-off; back-off doubles to a cap."""
from __future__ import annotations

from kvforge.kv.tiers.breaker import CircuitBreaker


def breaker(now: list[float]) -> CircuitBreaker:
    return CircuitBreaker(failures_to_open=3, backoff_s=1, max_backoff_s=3, slow_call_s=0.5, clock=lambda: now[0])


def test_fast_failures_open_after_three_in_a_row_and_a_success_resets_the_count():
    now = [0.0]
    b = breaker(now)
    for _ in range(2):
        b.failed(0.01)
    b.succeeded()
    b.failed(0.01)
    b.failed(0.01)
    assert not b.is_open and b.allow()
    b.failed(0.01)
    assert b.is_open and not b.allow() and not b.would_allow() and b.trips == 1


def test_a_slow_failure_opens_at_once():
    now = [0.0]
    b = breaker(now)
    b.failed(0.5)
    assert b.is_open and b.open_until == 1.0


def test_one_probe_after_the_back_off_and_the_back_off_doubles_up_to_its_cap():
    now = [0.0]
    b = breaker(now)
    b.failed(1.0)
    opened = []
    for _ in range(4):
        now[0] = b.open_until
        assert b.would_allow() and b.allow()  # the probe
        assert not b.would_allow() and not b.allow()  # nobody else while it runs
        start = now[0]
        b.failed(1.0)
        opened.append(b.open_until - start)
    assert opened == [2, 3, 3, 3] and b.trips == 5
    now[0] = b.open_until
    assert b.allow()
    b.succeeded()
    assert not b.is_open and b.allow() and b.allow()
    b.failed(1.0)
    assert b.open_until - now[0] == 1  # closed again: the back-off starts over
