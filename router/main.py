"""Start the router: the public Router service, the internal Registry on a port of its own
(cluster token required; mutual TLS with `tls`), a thread that evicts workers whose heartbeats
stopped, and (router.http_port) the OpenAI API."""

import contextlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2

from engine.tokenizer import Tokenizer
from proto.pdspec.v1 import router_pb2_grpc, worker_pb2_grpc
from proto.rpc import serve
from proto.tls import Tls
from router.admission import Admission
from router.api_keys import ApiKeys
from router.config import RouterConfig
from router.http_guard import MAX_REQUEST_BYTES
from router.http_server import HttpServer
from router.metrics import RouterMetrics
from router.openai_api import create_app
from router.registry import Registry, RegistryServicer
from router.service import RouterServicer

log = logging.getLogger(__name__)
ROUTER_SERVICE = "pdspec.v1.Router"
# A running or queued Generate holds one of the server's threads (created as needed): the
# admission queue runs at most this many at once, and the pool keeps room for the control RPCs.
_MAX_RUNNING, _CONTROL_THREADS = 512, 32


@dataclass
class RunningRouter:
    server: grpc.Server
    port: int
    internal_server: grpc.Server  # the Registry, where workers register
    internal_port: int
    http: HttpServer | None
    http_port: int | None  # None: the HTTP API is off
    router: RouterServicer

    def stop(self, grace_s: float = 2.0) -> None:
        """New requests are refused at once (readiness fails with them); running ones get `grace_s`
        to finish, then are cancelled. The Registry stops last: their workers stay known meanwhile."""
        public = self.server.stop(grace=grace_s)
        if self.http is not None:
            self.http.stop(grace_s)
        public.wait()
        self.router.close()
        self.internal_server.stop(grace=0).wait()


def run_router(rc: RouterConfig, token: str | None, model_dir: Path, model_name: str,
               port: int | None = None, internal_port: int | None = None, tls: Tls | None = None) -> RunningRouter:
    """Serve the public gRPC API on rc.host:`port` (None: rc.port; 0: a free one), the Registry on
    rc.host:`internal_port` (None: rc.internal_port) and, if rc.http_port is set, the OpenAI API on
    rc.host:rc.http_port (0: a free one). With `tls`, both gRPC ports use TLS and the Registry's
    callers must present a certificate of the cluster's CA.

    `token`: the cluster token internal services require; `model_dir` supplies the tokenizer and
    chat template, it must be the workers' model; `model_name`: what the HTTP API calls it."""
    # Readiness: the Router service is SERVING only while a request sent now has a route; the ""
    # service (liveness) stays SERVING while the process lives.
    health_servicer = health.HealthServicer()
    registry = Registry(on_change=lambda: health_servicer.set(ROUTER_SERVICE, _status(registry.can_serve())))
    api_keys = ApiKeys(rc.api_key_file) if rc.api_key_file is not None else None
    admission = Admission(lambda: min(registry.capacity(), _MAX_RUNNING), rc.max_queued_requests,
                          rc.max_queue_seconds)
    metrics = RouterMetrics(model_name, admission.snapshot)
    router = RouterServicer(registry, Tokenizer.from_dir(model_dir), rc, token, metrics, admission, api_keys,
                            tls=tls)
    with contextlib.ExitStack() as undo:  # a part that cannot start stops the parts started before it
        undo.callback(router.close)  # its watchdog thread
        # The HTTP port binds first: the gRPC health check passes only once every port is held, so a
        # launcher never takes a router for healthy that is about to exit over a taken port.
        http, http_port = None, None
        if rc.http_port is not None:
            authorized = (lambda header: api_keys.owner(header) is not None) if api_keys else (lambda header: True)
            app = create_app(router.Generate, model_name, metrics.registry, registry.can_serve, authorized,
                             metrics.refusal("http"))
            http = HttpServer(app, rc.host, rc.http_port, tls)
            http_port = http.start()
            undo.callback(http.stop, 0)
        registry_service = (worker_pb2_grpc.add_RegistryServicer_to_server,
                            RegistryServicer(registry, rc.heartbeat_interval_s, router.unreachable), "pdspec.v1.Registry")
        internal_server, internal_bound = serve(
            [registry_service], f"{rc.host}:{rc.internal_port if internal_port is None else internal_port}", token,
            internal=["pdspec.v1.Registry"], tls=tls)
        undo.callback(internal_server.stop, 0)
        address = f"{rc.host}:{rc.port if port is None else port}"
        # ListWorkers hands out internal addresses: only for callers with the cluster token, or without
        # one (an open cluster), at least an API key.
        public = {f"{ROUTER_SERVICE}/Generate", f"{ROUTER_SERVICE}/Abort"} | (
            set() if token else {f"{ROUTER_SERVICE}/ListWorkers"})
        server, bound = serve([(router_pb2_grpc.add_RouterServicer_to_server, router, ROUTER_SERVICE)], address,
                              token, internal=[f"{ROUTER_SERVICE}/ListWorkers"], health_servicer=health_servicer,
                              not_ready=[ROUTER_SERVICE],
                              max_workers=_MAX_RUNNING + rc.max_queued_requests + _CONTROL_THREADS,
                              gates=[api_keys.gate(public, metrics.refusal("grpc"))] if api_keys else [], tls=tls,
                              client_auth=False, max_receive_bytes=MAX_REQUEST_BYTES)
        undo.pop_all()
    threading.Thread(target=_evict_until_stopped, args=(server, registry, router, rc), name="router-evict",
                     daemon=True).start()
    log.info("router serving on %s:%d, registry on port %d (policy %s, cluster token %s, API keys %s, TLS %s)",
             rc.host, bound, internal_bound, rc.policy, "set" if token else "NOT set: internal services are open",
             rc.api_key_file or "off: the API is open", "on" if tls else "off")
    if http is not None:
        log.info("OpenAI API serving %s on %s://%s:%d/v1", model_name, "https" if tls else "http", rc.host, http_port)
    return RunningRouter(server, bound, internal_server, internal_bound, http, http_port, router)


def _status(ready: bool) -> int:
    return health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING


def _evict_until_stopped(server: grpc.Server, registry: Registry, router: RouterServicer, config: RouterConfig) -> None:
    # wait_for_termination returns True when it timed out, False once the server has stopped.
    while server.wait_for_termination(timeout=config.heartbeat_interval_s):
        for worker_id in registry.evict_stale(config.heartbeat_timeout_s):
            log.warning("evicted worker %s: no heartbeat for %.1fs", worker_id, config.heartbeat_timeout_s)
        router.forget_unregistered()
