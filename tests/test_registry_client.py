"""A worker's heartbeats to the router (serving/registry_client.py), against a registry that fails
on purpose: what a failed heartbeat carried is sent again."""

from concurrent import futures

import grpc

from engine.loop import EngineLoop
from engine.params import SamplingParams
from proto.pdspec.v1 import kv_pb2, worker_pb2, worker_pb2_grpc
from serving.registry_client import RegistryClient
from tests.waiting import wait_until


class _FlakyRegistry(worker_pb2_grpc.RegistryServicer):
    """Its first heartbeat fails (an injected fault: a router restarting); the arrivals each carried are kept."""

    def __init__(self):
        self.arrivals: list[list[str]] = []

    def Register(self, request, context):
        return worker_pb2.RegisterResponse(heartbeat_interval_ms=50)

    def Heartbeat(self, request, context):
        self.arrivals.append(list(request.arrived_request_ids))
        if len(self.arrivals) == 1:
            context.abort(grpc.StatusCode.UNAVAILABLE, "injected: the router restarts")
        return worker_pb2.HeartbeatResponse(registered=True)

    def Deregister(self, request, context):
        return worker_pb2.DeregisterResponse()


def test_a_failed_heartbeats_arrivals_go_in_the_next(engine, prompts):
    """Lost with it, an arrival stayed in the router's own pending count as well as in the worker's
    load until the request ended: the router steered requests away from the worker meanwhile."""
    registry = _FlakyRegistry()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    worker_pb2_grpc.add_RegistryServicer_to_server(registry, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    loop = EngineLoop(engine)
    registration = worker_pb2.RegisterRequest(worker_id="w", role="aggregated", address="127.0.0.1:1",
                                              layout=kv_pb2.KVLayout(model="m", dtype="float32", block_size=16))
    client = RegistryClient(f"127.0.0.1:{port}", None, registration, loop, interval_s=0.05)
    try:
        outputs = loop.submit("arrived", prompts[0], SamplingParams(max_tokens=4))  # named by the next heartbeat
        client.start()
        wait_until(lambda: len(registry.arrivals) >= 3, "no heartbeats after the failed one", 30)
        assert registry.arrivals[0] == registry.arrivals[1] == ["arrived"] and registry.arrivals[2] == []
        while not outputs.get(timeout=30).finished:
            pass
    finally:
        client.stop()
        loop.stop()
        server.stop(0)
