"""Prometheus metrics of a worker, read from its engine at scrape time (no hot-path cost)."""

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry

from engine.loop import EngineLoop


class EngineCollector:
    def __init__(self, loop: EngineLoop, role: str, worker_id: str):
        self.loop, self.labels = loop, {"role": role, "worker": worker_id}

    def collect(self):
        engine = self.loop.engine
        gauges = {
            "pdspec_kv_blocks_used": ("KV blocks in use", engine.blocks.num_used_blocks),
            "pdspec_kv_blocks_total": ("KV blocks in the pool", engine.blocks.num_blocks),
            "pdspec_requests_running": ("sequences in the running batch", len(engine.scheduler.running)),
            "pdspec_requests_waiting": ("sequences waiting for a batch slot or KV",
                                        len(engine.scheduler.waiting) + len(engine.incoming)),
            "pdspec_requests_pinned": ("prefilled requests whose blocks await the decode side", len(engine.handed_off)),
        }
        for name, (doc, value) in gauges.items():
            yield _one(GaugeMetricFamily, name, doc, self.labels, value)
        counters = dict(engine.counters)
        counters["draft_positions_with_target_features"] = getattr(engine.proposer, "positions_drafted", 0)
        for key, value in sorted(counters.items()):
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
