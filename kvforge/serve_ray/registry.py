"""Process-wide state shared by the routers and the ingress's /metrics.

Ray ships the router class to the ingress by value (cloudpickle), so its module globals are a private copy;
state that the ingress must see lives here and is reached with an import at call time.
"""
from __future__ import annotations

import weakref
from collections import Counter

ROUTER_CHOICES: Counter = Counter()  # (policy, decision) -> requests routed by this process's routers
ROUTERS: weakref.WeakSet = weakref.WeakSet()  # the routers of this process's handles


def register(router) -> None:
    ROUTERS.add(router)


def count(policy: str, decision: str) -> None:
    ROUTER_CHOICES[policy, decision] += 1


def forget(replica: str, hashes: list[str]) -> None:
    """The app on `replica` (its unique id) refused a request: no router counts its chunks as held there."""
    for router in list(ROUTERS):
        if hasattr(router, "forget"):
            router.forget(replica, hashes)
