"""What every worker process does around its own gRPC services: the engine and its loop, the
server, the /metrics endpoint, registration and heartbeats with the router, and shutdown.

`prefill_worker/main.py` and `decode_worker/main.py` add their services; `deploy/worker.py`
picks one by role. Launchers (local processes, Ray actors, Kubernetes pods) all come through it.
"""

import logging
import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import grpc
from prometheus_client.registry import Collector

from engine.config import EngineConfig
from engine.engine import Engine
from engine.loop import EngineLoop
from kvtransfer.layout import layout_to_proto
from proto.pdspec.v1 import kv_pb2
from proto.rpc import serve
from proto.tls import Tls
from serving.metrics import serve_metrics
from serving.call_limit import CallLimit, request_call_limit
from serving.engine_health import EngineHealth
from serving.registry_client import RegistryClient, registration

log = logging.getLogger(__name__)
_CONTROL_THREADS = 32  # server threads beyond the requests' (see bind)
SETTLE_S = 2.0  # a draining worker waits this long after the last call came or ended (see RunningWorker.stop)

# (add_XServicer_to_server, servicer, full service name): one gRPC service of the worker.
Service = tuple[Callable[[Any, grpc.Server], None], Any, str]


class Closeable(Protocol):
    def close(self) -> None: ...


@dataclass
class WorkerSpec:
    """Where and how one worker process runs (deploy/ fills it from the deployment config)."""

    role: str
    engine: EngineConfig  # with this role's threads and tensor-parallel size
    router_address: str
    token: str | None
    heartbeat_interval_s: float
    tls: Tls | None = None  # mutual TLS on the worker's port and every channel it opens
    port: int = 0  # 0: any free port
    metrics_port: int = 0
    host: str = "127.0.0.1"
    advertise_host: str | None = None  # the host other processes reach us at (default: host)
    worker_id: str | None = None

    def __post_init__(self) -> None:
        self.worker_id = self.worker_id or f"{self.role}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"


@dataclass
class RunningWorker:
    worker_id: str
    role: str
    address: str
    server: grpc.Server
    loop: EngineLoop
    registry: RegistryClient
    metrics_server: Any
    calls: CallLimit  # the Prefill or Decode calls being served
    closers: list[Closeable] = field(default_factory=list)  # KV sources and connectors

    def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Deregister (the router routes nothing new here), let what runs finish for up to
        `drain_timeout_s` (requests in the engine, prefilled blocks awaiting their decode worker,
        then the streams' last messages), then shut down. Calls routed here before the
        Deregister may still arrive (a decode worker is chosen before its request's prefill
        runs): the drain lasts until none came or ended for SETTLE_S."""
        self.registry.stop()
        log.info("worker %s stopping: deregistered, draining for up to %.0fs", self.worker_id, drain_timeout_s)
        settle_from = time.monotonic()
        deadline = settle_from + drain_timeout_s
        while time.monotonic() < deadline and (_busy(self.loop, self.calls) or
                                               time.monotonic() - max(settle_from, self.calls.changed) < SETTLE_S):
            time.sleep(0.05)
        busy = _busy(self.loop, self.calls)
        if busy:
            log.warning("worker %s stopping with %s after its drain of %.0fs", self.worker_id, busy, drain_timeout_s)
        self.server.stop(grace=max(2.0, deadline - time.monotonic())).wait()
        self.metrics_server.shutdown()
        self.metrics_server.server_close()  # its socket: a restart in this process binds the port again
        for part in self.closers:
            part.close()
        self.loop.stop()
        self.loop.engine.close()


def _busy(loop: EngineLoop, calls: CallLimit) -> str:
    """What the worker still runs ("" if nothing)."""
    stats = loop.stats()
    counts = {"running": stats.running, "waiting": stats.waiting, "pinned for hand-off": stats.pinned,
              "calls being served": calls.active}
    return ", ".join(f"{n} {what}" for what, n in counts.items() if n)


def start_engine(spec: WorkerSpec) -> EngineLoop:
    """The worker's engine, stepped by its own thread."""
    return EngineLoop(Engine(spec.engine))


def kv_caches(loop: EngineLoop) -> dict[str, Any]:
    """The engine's KV caches by name, as the KV layout names them."""
    runner = loop.engine.runner
    return {"target": runner.kv_cache} | ({"draft": runner.draft_cache} if runner.draft_cache is not None else {})


def layout_message(loop: EngineLoop) -> kv_pb2.KVLayout:
    return layout_to_proto(loop.engine.runner.layout)


def bind(spec: WorkerSpec, loop: EngineLoop, services: list[Service]) -> tuple[grpc.Server, str, EngineHealth]:
    """Serve `services` (all internal: the cluster token is required), health checks answering as
    the engine loop serves, and the first service's (readiness) once the router knows the worker.
    Returns the server, the address other workers and the router dial, and the health servicer."""
    # Threads for the request calls (serving/call_limit.py caps them), as many for KV pulls of a
    # prefill worker's pinned requests, and the control RPCs (health checks, Abort, Release).
    health = EngineHealth(loop, ready_service=services[0][2])
    server, bound = serve(services, f"{spec.host}:{spec.port}", spec.token, internal=[name for _, _, name in services],
                          max_workers=2 * request_call_limit(spec.engine.max_num_seqs) + _CONTROL_THREADS,
                          health_servicer=health, not_ready=[health.ready_service], tls=spec.tls)
    return server, f"{spec.advertise_host or spec.host}:{bound}", health


def announce(spec: WorkerSpec, loop: EngineLoop, server: grpc.Server, address: str, health: EngineHealth,
             closers: list[Closeable], kv_transfer: str, calls: CallLimit,
             collectors: Iterable[Collector] = ()) -> RunningWorker:
    """Export metrics (the engine's, and `collectors`) and register with the router, which routes
    to the worker once the first heartbeat lands."""
    metrics_server, metrics_port = serve_metrics(loop, spec.role, spec.worker_id, spec.host, spec.metrics_port,
                                                 health, collectors)
    engine = loop.engine
    request = registration(spec.worker_id, spec.role, address, layout_message(loop), engine.blocks.num_blocks,
                           engine.context_limit(), spec.engine.max_num_seqs)
    request.metrics_address = f"{spec.advertise_host or spec.host}:{metrics_port}"
    registry = RegistryClient(spec.router_address, spec.token, request, loop, interval_s=spec.heartbeat_interval_s,
                              tls=spec.tls, on_registered=health.registered)
    registry.start()
    log.info("%s worker %s serving on %s (model %s, draft %s, K=%d, %d KV blocks, transfer %s)",
             spec.role, spec.worker_id, address, engine.runner.model_dir, spec.engine.speculative.model or
             ("embedded" if engine.runner.draft else "none"), engine.num_speculative_tokens, engine.blocks.num_blocks,
             kv_transfer)
    return RunningWorker(spec.worker_id, spec.role, address, server, loop, registry, metrics_server, calls, closers)
