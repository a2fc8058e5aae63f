"""The router's request metrics: what a client feels (time to first token, inter-token latency,
end-to-end latency, queueing) and what it got (tokens, prefix-cache hits, speculation).

Observed on the Generate stream the router relays, so both public fronts count once (the HTTP
front calls the gRPC one). Names, units and buckets follow vLLM's `vllm:` request metrics;
prometheus-client adds `_total` to counters and `_bucket`/`_sum`/`_count` to histograms.
"""

import threading
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proto.pdspec.v1 import router_pb2

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    """The router's Prometheus registry and its request metrics, labelled by the served model."""

    def __init__(self, model_name: str, admission: Callable[[], tuple[int, int]]) -> None:
        """`admission`: (requests running, requests waiting in the admission queue) now."""
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        model = ["model"]
        Gauge("pdspec_num_requests_running", "requests holding a running slot", registry=r).set_function(
            lambda: admission()[0])
        Gauge("pdspec_num_requests_waiting", "requests waiting in the router's admission queue",
              registry=r).set_function(lambda: admission()[1])
        self.ttft = Histogram("pdspec_time_to_first_token_seconds", "request arrival at the router to its first token",
                              model + ["prefill_worker"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("pdspec_inter_token_latency_seconds",
                             "time per output token after the first (a message's gap spread over its tokens)",
                             model + ["decode_worker"], buckets=ITL_BUCKETS, registry=r)
        # The workers those two are labelled by: a worker's series go when it leaves (on Kubernetes
        # its id is its pod's name, new at every rollout: kept, they grew without end).
        self._labelled: set[tuple[Histogram, str]] = set()
        self._labelled_lock = threading.Lock()
        self.e2e = Histogram("pdspec_e2e_request_latency_seconds", "request arrival to its last message", model,
                             buckets=E2E_BUCKETS, registry=r)
        self.queue = Histogram("pdspec_request_queue_seconds",
                               "time waiting in the router's admission queue and a worker's queue before the "
                               "prompt's computation started", model,
                               buckets=QUEUE_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdspec_prompt_tokens", "prompt tokens of finished requests", model, registry=r)
        self.cached_prompt_tokens = Counter("pdspec_prefix_cache_hit_tokens",
                                            "prompt tokens served from a prefix cache", model, registry=r)
        self.generation_tokens = Counter("pdspec_generation_tokens", "tokens generated", model, registry=r)
        self.requests = Counter("pdspec_requests", "finished requests by finish reason and gRPC status",
                                model + ["finish_reason", "status"], registry=r)
        self.refused = Counter("pdspec_requests_refused", "requests refused before they reached the router's "
                               "Generate (no current API key, a body too large), by front and status", model +
                               ["front", "status"], registry=r)
        self.spec_steps = Counter("pdspec_spec_verification_steps", "verification steps that drafted", model,
                                  registry=r)
        self.spec_drafted = Counter("pdspec_spec_draft_tokens", "draft tokens proposed", model, registry=r)
        self.spec_accepted = Counter("pdspec_spec_accepted_tokens", "draft tokens accepted", model, registry=r)
        self.spec_accepted_at = Counter("pdspec_spec_accepted_tokens_per_position",
                                        "draft tokens accepted at each draft position", model + ["position"],
                                        registry=r)

    def start(self) -> "RequestObserver":
        return RequestObserver(self)

    def by_worker(self, histogram: Histogram, worker_id: str):
        """`histogram` (ttft or itl)'s series for `worker_id`, remembered until the worker leaves."""
        with self._labelled_lock:  # (with its series: keep_workers removes the two together)
            self._labelled.add((histogram, worker_id))
            return histogram.labels(self.model_name, worker_id)

    def keep_workers(self, worker_ids: Iterable[str]) -> None:
        """Drop the per-worker series of every worker not in `worker_ids` (the registered ones)."""
        keep = set(worker_ids)
        with self._labelled_lock:
            gone = {(h, wid) for h, wid in self._labelled if wid not in keep}
            self._labelled -= gone
            for histogram, wid in gone:
                histogram.remove(self.model_name, wid)

    def refusal(self, front: str) -> Callable[[str], None]:
        """What a front calls with the status it refused a request with (HTTP's code, gRPC's name)."""
        return lambda status: self.refused.labels(self.model_name, front, status).inc()


class RequestObserver:
    """One Generate: `on_response` for every message relayed, `finish` once with its status."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._m, self._model = metrics, metrics.model_name
        self._arrived = self._last = time.perf_counter()
        self._decode_worker = ""
        self._finish_reason = ""
        self._tokens = 0

    def on_response(self, response: router_pb2.GenerateResponse) -> None:
        now, m = time.perf_counter(), self._m
        if response.decode_worker:  # the first message names the route
            self._decode_worker = response.decode_worker
            m.by_worker(m.ttft, response.prefill_worker).observe(now - self._arrived)
        elif response.token_ids:
            gap = (now - self._last) / len(response.token_ids)
            itl = m.by_worker(m.itl, self._decode_worker)
            for _ in response.token_ids:
                itl.observe(gap)
        self._last = now
        self._tokens += len(response.token_ids)
        if response.finish_reason:
            self._finish_reason = response.finish_reason
            self._final(response)

    def _final(self, response: router_pb2.GenerateResponse) -> None:
        m, model = self._m, self._model
        m.prompt_tokens.labels(model).inc(response.usage.prompt_tokens)
        m.cached_prompt_tokens.labels(model).inc(response.usage.cached_prompt_tokens)
        if response.finish_reason != "abort":  # an abort's usage comes from the router, without a queue time
            m.queue.labels(model).observe(response.usage.queue_seconds)
        a = response.acceptance
        m.spec_steps.labels(model).inc(a.steps)
        m.spec_drafted.labels(model).inc(a.drafted)
        m.spec_accepted.labels(model).inc(a.accepted)
        for position, accepted in enumerate(a.accepted_per_position):
            m.spec_accepted_at.labels(model, str(position)).inc(accepted)

    def finish(self, status: str) -> None:
        """`status`: the gRPC status code's name the stream ended with (OK, INVALID_ARGUMENT, ...)."""
        m, model = self._m, self._model
        m.generation_tokens.labels(model).inc(self._tokens)
        if self._finish_reason:  # served (not refused)
            m.e2e.labels(model).observe(time.perf_counter() - self._arrived)
        m.requests.labels(model, self._finish_reason or "error", status).inc()
