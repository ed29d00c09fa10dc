"""kvforge on Ray Serve: many engine replicas behind one OpenAI endpoint, routed by prefix affinity.

ingress.py (one HTTP deployment) -> router.py (picks a replica per request) -> replica.py (one LLMEngine and the
same FastAPI app as `kvforge serve`, called in-process); launcher.py starts it all. Ray is an optional extra.
"""
from __future__ import annotations

from kvforge.errors import ConfigError

INSTALL_HINT = "pip install 'kvforge[ray]' (Ray Serve >= 2.60)"


def require_ray() -> None:
    """Raise a ConfigError that says how to install Ray Serve when it is missing."""
    try:
        import ray  # noqa: F401
        from ray.serve.request_router import RequestRouter  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"--ray needs Ray Serve with the request-router API ({e}); install it with: "
                          f"{INSTALL_HINT}") from None
