"""Start the router: the public Router service, the internal Registry (cluster token required),
and a thread that evicts workers whose heartbeats stopped."""

import logging
import threading
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2

from engine.tokenizer import Tokenizer
from proto.pdspec.v1 import router_pb2_grpc, worker_pb2_grpc
from proto.rpc import serve
from router.config import RouterConfig
from router.registry import Registry
from router.service import RegistryServicer, RouterServicer

log = logging.getLogger(__name__)
ROUTER_SERVICE = "pdspec.v1.Router"


def run_router(rc: RouterConfig, token: str | None, model_dir: Path, port: int | None = None) -> tuple[grpc.Server, int]:
    """Serve on rc.host:`port` (None: rc.port; 0: a free one); returns the server and its port.

    `token`: the cluster token internal services require; `model_dir` supplies the tokenizer and
    chat template, it must be the workers' model."""
    # Readiness: the Router service is SERVING only while a request sent now has a route; the ""
    # service (liveness) stays SERVING while the process lives.
    health_servicer = health.HealthServicer()
    registry = Registry(on_change=lambda: health_servicer.set(ROUTER_SERVICE, _status(registry.can_serve())))
    services = [
        (router_pb2_grpc.add_RouterServicer_to_server, RouterServicer(registry, Tokenizer.from_dir(model_dir), rc, token),
         ROUTER_SERVICE),
        (worker_pb2_grpc.add_RegistryServicer_to_server, RegistryServicer(registry, rc.heartbeat_interval_s),
         "pdspec.v1.Registry"),
    ]
    address = f"{rc.host}:{rc.port if port is None else port}"
    server, bound = serve(services, address, token, internal=["pdspec.v1.Registry"], health_servicer=health_servicer,
                          not_ready=[ROUTER_SERVICE])
    threading.Thread(target=_evict_until_stopped, args=(server, registry, rc), name="router-evict", daemon=True).start()
    log.info("router serving on %s:%d (policy %s, cluster token %s)", rc.host, bound, rc.policy,
             "set" if token else "NOT set: internal services are open")
    return server, bound


def _status(ready: bool) -> int:
    return health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING


def _evict_until_stopped(server: grpc.Server, registry: Registry, config: RouterConfig) -> None:
    # wait_for_termination returns True when it timed out, False once the server has stopped.
    while server.wait_for_termination(timeout=config.heartbeat_interval_s):
        for worker_id in registry.evict_stale(config.heartbeat_timeout_s):
            log.warning("evicted worker %s: no heartbeat for %.1fs", worker_id, config.heartbeat_timeout_s)
