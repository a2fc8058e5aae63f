"""A worker's heartbeats to the router (serving/registry_client.py), against registries that fail
on purpose: what a failed heartbeat carried is sent again, and a worker stopping deregisters the
registration the router knows."""

import contextlib
from collections.abc import Iterator
from concurrent import futures

import grpc

from engine.loop import EngineLoop
from engine.params import SamplingParams
from proto.pdspec.v1 import kv_pb2, worker_pb2, worker_pb2_grpc
from serving.registry_client import RegistryClient
from tests.waiting import wait_until


class _FlakyRegistry(worker_pb2_grpc.RegistryServicer):
    """Its first heartbeat fails (an injected fault: a router restarting), and with `refusing`,
    every Register after the first; it keeps the arrivals each heartbeat carried, the registrations
    it was asked for, those it accepted and those deregistered."""

    def __init__(self, refusing: bool = False):
        self.refusing, self.arrivals, self.asked, self.accepted, self.deregistered = refusing, [], [], [], []

    def Register(self, request, context):
        self.asked.append(request.registration_id)
        if self.refusing and self.accepted:
            context.abort(grpc.StatusCode.UNAVAILABLE, "injected: still restarting")
        self.accepted.append(request.registration_id)
        return worker_pb2.RegisterResponse(heartbeat_interval_ms=50)

    def Heartbeat(self, request, context):
        self.arrivals.append(list(request.arrived_request_ids))
        if len(self.arrivals) == 1:
            context.abort(grpc.StatusCode.UNAVAILABLE, "injected: the router restarts")
        return worker_pb2.HeartbeatResponse(registered=True)

    def Deregister(self, request, context):
        self.deregistered.append(request.registration_id)
        return worker_pb2.DeregisterResponse()


@contextlib.contextmanager
def _heartbeating(engine, registry: _FlakyRegistry) -> Iterator[tuple[EngineLoop, RegistryClient]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    worker_pb2_grpc.add_RegistryServicer_to_server(registry, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    loop = EngineLoop(engine)
    registration = worker_pb2.RegisterRequest(worker_id="w", role="aggregated", address="127.0.0.1:1",
                                              layout=kv_pb2.KVLayout(model="m", dtype="float32", block_size=16))
    client = RegistryClient(f"127.0.0.1:{port}", None, registration, loop, interval_s=0.05)
    try:
        yield loop, client
    finally:
        client.stop()
        loop.stop()
        server.stop(0)


def test_a_failed_heartbeats_arrivals_go_in_the_next(engine, prompts):
    """Lost with it, an arrival stayed in the router's own pending count as well as in the worker's
    load until the request ended: the router steered requests away from the worker meanwhile."""
    registry = _FlakyRegistry()
    with _heartbeating(engine, registry) as (loop, client):
        outputs = loop.submit("arrived", prompts[0], SamplingParams(max_tokens=4))  # named by the next heartbeat
        client.start()
        wait_until(lambda: len(registry.arrivals) >= 3, "no heartbeats after the failed one", 30)
        assert registry.arrivals[0] == registry.arrivals[1] == ["arrived"] and registry.arrivals[2] == []
        while not outputs.get(timeout=30).finished:
            pass


def test_a_worker_stopping_deregisters_the_registration_the_router_accepted(engine):
    """Its Register failing since its last heartbeat failed, the worker deregistered only the id it
    had asked for last, which the router never accepted: it kept routing to the stopping worker until
    its heartbeats were missed."""
    registry = _FlakyRegistry(refusing=True)
    with _heartbeating(engine, registry) as (_, client):
        client.start()
        wait_until(lambda: len(registry.asked) >= 2, "no Register after the failed heartbeat", 30)
    assert len(registry.accepted) == 1 and registry.accepted[0] in registry.deregistered
