"""Prometheus metrics of a worker, read from its engine's stats snapshot at scrape time (no
hot-path cost)."""

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry

from engine.loop import EngineLoop


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


def serve_metrics(loop: EngineLoop, role: str, worker_id: str, host: str, port: int) -> tuple[object, int]:
    """Start the /metrics HTTP endpoint; port 0 picks a free one. Returns (server, port)."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(loop, role, worker_id))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, server.server_port
