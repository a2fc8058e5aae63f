"""What the router counts as a worker's load while an attempt fails and its retry runs: a
worker's heartbeat naming the failed attempt's request lands late, and must not drop the retry's
count. A real router over fake workers (tests/test_router_faults.py)."""

import threading

import grpc
from grpc_health.v1 import health

from proto.pdspec.v1 import router_pb2, worker_pb2, worker_pb2_grpc
from proto.rpc import FAILED_KV_SOURCE_METADATA_KEY
from tests.test_router_faults import _PrefillWorker, _router_over_fakes, _SlowDecodeWorker, _SourceBlamingDecodeWorker
from tests.test_router_server import HELLO


def _report_arrival(registry: worker_pb2_grpc.RegistryStub, worker_id: str, request_id: str) -> None:
    """A worker's heartbeat naming `request_id` as arrived (the fakes' late report)."""
    registry.Heartbeat(worker_pb2.HeartbeatRequest(worker_id=worker_id, load=worker_pb2.Load(total_blocks=64),
                                                   arrived_request_ids=[request_id]), timeout=10)


class _HealthyPrefillWorker(_PrefillWorker):
    def __init__(self, worker_id: str):
        super().__init__(worker_id)
        self.health = health.HealthServicer()  # SERVING: the probe after a blamed hand-off keeps it routed


class _LateReportingPrefillWorker(_HealthyPrefillWorker):
    """A prefill worker whose heartbeat naming a request's first prefill lands while its retry's
    prefill runs (the first attempt's blocks freed by then). Healthy: the probe after the blamed
    hand-off keeps it routed."""

    registry: worker_pb2_grpc.RegistryStub | None = None  # set once it registered

    def Prefill(self, request, context):
        if self.prefills == 1:
            _report_arrival(self.registry, self.worker_id, request.request_id)
        return super().Prefill(request, context)


def test_a_late_report_of_a_failed_attempt_leaves_the_retry_counted(model_dir):
    """The decode side failed after the prefill ran; the retry's prefill goes to the same worker
    under the same request id while that worker names the first one, late. The retry still counts
    in the worker's load (dropped there, the worker looked idle until its next heartbeat)."""
    prefill = _LateReportingPrefillWorker("prefill-a")
    fakes = {"prefill-a": prefill, "decode-a": _SourceBlamingDecodeWorker(refusals=10, code=grpc.StatusCode.UNAVAILABLE),
             "decode-b": _SlowDecodeWorker(first=1)}
    with _router_over_fakes(model_dir, fakes) as router:
        stream = router.Generate(HELLO, timeout=30)
        assert next(stream).text == "x"
        loads = {w.worker_id: (w.running, w.active_blocks)
                 for w in router.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10).workers}
        stream.cancel()
    assert prefill.prefills == 2 and loads["prefill-a"] == (1, 1)


class _LateReportingDecodeWorker(worker_pb2_grpc.DecodeWorkerServicer):
    """The only decode worker: its first call took the request over and blames the KV source (an
    injected fault); in the retry, its heartbeat naming the first attempt's arrival lands late, then
    it streams until the test has read the loads."""

    registry: worker_pb2_grpc.RegistryStub | None = None  # set once it registered

    def __init__(self):
        self.calls, self.read = 0, threading.Event()

    def Decode(self, request, context):
        self.calls += 1
        if self.calls == 1:
            context.set_trailing_metadata([(FAILED_KV_SOURCE_METADATA_KEY, request.prefilled.source_worker_id)])
            context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer from {request.prefilled.source_worker_id} "
                          "failed: NIXL_ERR_BACKEND")
        _report_arrival(self.registry, "decode-a", request.request_id)
        yield worker_pb2.DecodeResponse(token_ids=[42], text="x")
        self.read.wait(30)
        yield worker_pb2.DecodeResponse(token_ids=[43], text="y", finish_reason="length")


def test_a_decode_workers_late_report_of_a_failed_attempt_leaves_the_retry_counted(model_dir):
    """A decode worker takes a request over before it pulls its KV: when the pull fails and the retry
    comes back to it, its heartbeat naming the first attempt dropped the retry's count (the worker
    looked idle while it decoded)."""
    decode = _LateReportingDecodeWorker()
    with _router_over_fakes(model_dir, {"prefill-a": _HealthyPrefillWorker("prefill-a"), "decode-a": decode}) as router:
        stream = router.Generate(HELLO, timeout=30)
        assert next(stream).text == "x"
        workers = router.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10).workers
        loads = {w.worker_id: w.running for w in workers}
        decode.read.set()
        assert [r.text for r in stream] == ["y"]
    assert decode.calls == 2 and loads["decode-a"] == 1
