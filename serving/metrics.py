"""Prometheus metrics of a worker: its engine's stats snapshot, read at scrape time (no hot-path
cost), and, on a decode worker, the KV hand-offs it pulled."""

import threading
from collections.abc import Iterable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

# A hand-off moves a prompt's blocks: ~1 ms for a short prompt over NIXL, seconds for a long one over gRPC.
HANDOFF_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

from engine.loop import EngineLoop
from serving.engine_health import EngineHealth


class EngineCollector:
    def __init__(self, loop: EngineLoop, role: str, worker_id: str):
        self.loop, self.labels = loop, {"role": role, "worker": worker_id}

    def collect(self):
        stats = self.loop.stats()
        gauges = {
            "pdspec_kv_blocks_used": ("KV blocks in use", stats.kv_blocks_used),
            "pdspec_kv_blocks_total": ("KV blocks in the pool", stats.kv_blocks_total),
            "pdspec_requests_running": ("sequences in the running batch", stats.running),
            "pdspec_requests_waiting": ("sequences waiting for a batch slot or KV", stats.waiting),
            "pdspec_requests_pinned": ("prefilled requests whose blocks await the decode side", stats.pinned),
        }
        for name, (doc, value) in gauges.items():
            yield _one(GaugeMetricFamily, name, doc, self.labels, value)
        for key, value in sorted(stats.counters.items()):
            yield _one(CounterMetricFamily, f"pdspec_{key}", f"total {key.replace('_', ' ')}", self.labels, value)


def _one(family, name, doc, labels, value):
    metric = family(name, doc, labels=list(labels))
    metric.add_metric(list(labels.values()), value)
    return metric


class HandoffMetrics:
    """KV hand-offs a decode worker pulled from prefill workers: seconds per request (pull and
    release) and bytes moved."""

    def __init__(self, worker_id: str) -> None:
        self.registry = CollectorRegistry()
        self.worker_id = worker_id
        self.seconds = Histogram("pdspec_kv_transfer_seconds", "KV hand-off time per request (pull and release)",
                                 ["worker"], buckets=HANDOFF_SECONDS_BUCKETS, registry=self.registry)
        self.bytes = Counter("pdspec_kv_transfer_bytes", "KV bytes pulled from prefill workers", ["worker"],
                             registry=self.registry)

    def observe(self, seconds: float, num_bytes: int) -> None:
        self.seconds.labels(self.worker_id).observe(seconds)
        self.bytes.labels(self.worker_id).inc(num_bytes)

    def collect(self):
        return self.registry.collect()


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # a line per scrape and probe otherwise
        pass


def serve_metrics(loop: EngineLoop, role: str, worker_id: str, host: str, port: int, health: EngineHealth,
                  collectors: Iterable[Collector] = ()) -> tuple[WSGIServer, int]:
    """Start the plain-HTTP endpoint: /metrics, and /health and /ready answering as `health`'s
    liveness and readiness do (200, else 503): with TLS on the worker's gRPC port, the kubelet's
    plaintext probes come here. Port 0 picks a free one. Returns (server, port)."""
    registry = CollectorRegistry()
    for collector in (EngineCollector(loop, role, worker_id), *collectors):
        registry.register(collector)
    metrics = make_wsgi_app(registry)

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path not in ("/health", "/ready"):
            return metrics(environ, start_response)
        ok = health.live() if path == "/health" else health.ready()
        start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
        return [b"ok\n" if ok else b"not serving\n"]

    server = make_server(host, port, app, _Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server, server.server_port
