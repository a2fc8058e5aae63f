"""deploy/readiness.py: a launcher waits for the workers it started to be listed by the router."""

from concurrent import futures

import grpc

from deploy.readiness import wait_for_workers
from proto.pdspec.v1 import router_pb2, router_pb2_grpc


class _BusyRouter(router_pb2_grpc.RouterServicer):
    """Its first ListWorkers runs out of time (an injected fault: a router busy starting up), then
    it lists the worker."""

    def __init__(self):
        self.calls = 0

    def ListWorkers(self, request, context):
        self.calls += 1
        if self.calls == 1:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "injected: the router answered late")
        return router_pb2.ListWorkersResponse(workers=[router_pb2.WorkerStatus(worker_id="decode-0")])


def test_a_router_slow_to_list_is_asked_again():
    """A DEADLINE_EXCEEDED escaped the wait as a raw gRPC error (a traceback from the launcher)."""
    router, server = _BusyRouter(), grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    router_pb2_grpc.add_RouterServicer_to_server(router, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        wait_for_workers(f"127.0.0.1:{port}", None, ["decode-0"], 30, lambda: None)
    finally:
        server.stop(0)
    assert router.calls == 2
