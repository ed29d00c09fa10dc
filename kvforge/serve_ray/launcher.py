"""Start (or join) Ray, deploy the ingress and the replicas, and serve until stopped."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from kvforge.errors import ConfigError
from kvforge.server import ServerConfig

APP_NAME = "kvforge"
ROUTERS = {"prefix": "kvforge.serve_ray.router:PrefixAffinityRouter", "pow2": "kvforge.serve_ray.router:Pow2Router"}


@dataclass
class RayDeployment:
    engine_kwargs: dict
    server_config: ServerConfig = field(default_factory=ServerConfig)
    num_replicas: int = 2
    autoscale: tuple[int, int] | None = None  # (min, max) replicas; overrides num_replicas
    routing: str = "prefix"
    cpus_per_replica: float = 1.0
    max_ongoing_requests: int = 256
    stats_period_s: float = 1.0
    router_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.routing not in ROUTERS:
            raise ConfigError(f"routing {self.routing!r} is unknown; use one of {sorted(ROUTERS)}")
        if self.num_replicas < 1:
            raise ConfigError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.autoscale is not None and not 0 <= self.autoscale[0] <= self.autoscale[1] or \
                self.autoscale is not None and self.autoscale[1] < 1:
            raise ConfigError(f"autoscale MIN:MAX needs 0 <= MIN <= MAX and MAX >= 1, got {self.autoscale}")


def parse_autoscale(text: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--autoscale takes MIN:MAX replica counts, e.g. 1:4; got {text!r}") from None
    return low, high


def build_application(d: RayDeployment):
    """The Serve application: the ingress in front of the replica deployment, routed as d.routing says."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvforge.serve_ray.ingress import KVForgeIngress
    from kvforge.serve_ray.replica import KVForgeReplica

    router = RequestRouterConfig(request_router_class=ROUTERS[d.routing], request_router_kwargs=d.router_kwargs,
                                 request_routing_stats_period_s=d.stats_period_s,
                                 request_routing_stats_timeout_s=max(5.0, 4 * d.stats_period_s))
    scale = ({"autoscaling_config": {"min_replicas": d.autoscale[0], "max_replicas": d.autoscale[1]}}
             if d.autoscale else {"num_replicas": d.num_replicas})
    threads = max(1, int(d.cpus_per_replica))
    replica = serve.deployment(KVForgeReplica, name="KVForgeReplica", **scale, request_router_config=router,
                               ray_actor_options={"num_cpus": d.cpus_per_replica},
                               max_ongoing_requests=d.max_ongoing_requests, health_check_period_s=2,
                               health_check_timeout_s=30)
    ingress = serve.deployment(KVForgeIngress, name="KVForgeIngress",
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
    return ingress.bind(replica.bind(d.engine_kwargs, d.server_config, threads), d.server_config.limits.max_body_bytes)


def start(d: RayDeployment, host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
          num_cpus: int | None = None) -> str:
    """Start a local Ray (address None) or join one, deploy, and return the endpoint's URL once replicas serve."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        local = {} if address else {"num_cpus": num_cpus, "include_dashboard": False,
                                    "object_store_memory": 128 << 20}
        ray.init(address=address, log_to_driver=False, **local)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_application(d), name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}"


def stop() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def serve_forever(d: RayDeployment, host: str, port: int, address: str | None) -> int:
    url = start(d, host, port, address)
    scale = f"autoscaling {d.autoscale[0]}..{d.autoscale[1]}" if d.autoscale else f"{d.num_replicas} replicas"
    print(f"kvforge: serving the OpenAI API at {url}/v1 on Ray Serve ({scale}, {d.routing} routing, "
          f"{d.cpus_per_replica:g} CPU each); Ctrl-C stops", file=sys.stderr, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if address:
            from ray import serve

            serve.delete(APP_NAME)
        else:
            stop()
    return 0
