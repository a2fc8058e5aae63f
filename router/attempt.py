"""One attempt to serve a request: the workers chosen for it, and how a worker's failure reads,
for the router's log, the client, and the retry that follows (router/service.py)."""

import re
from dataclasses import dataclass

import grpc

from proto import rpc
from router.registry import WorkerView

# An IP address, bare or as gRPC writes a peer (ipv4:10.0.0.5:50051, ipv6:[fe80::1]:50051), with its port.
_NETWORK_ADDRESS = re.compile(r"(?:ipv[46]:)?(?:\[[0-9a-fA-F.]*:[0-9a-fA-F:.]*\]|\b\d{1,3}(?:\.\d{1,3}){3}\b)(?::\d+)?")


class WorkerFailed(Exception):
    def __init__(self, worker: WorkerView, step: str, error: grpc.RpcError | str,
                 reported_by: WorkerView | None = None) -> None:
        self.worker = worker
        self.reported_by = reported_by  # the decode worker that blamed `worker`, its KV source
        self.code = error.code() if isinstance(error, grpc.RpcError) else grpc.StatusCode.UNAVAILABLE
        # The worker called refused the request itself (no worker will take it), rather than reporting
        # another worker's fault (a decode worker refusing the prefill worker's handle).
        self.request_refused = self.code == grpc.StatusCode.INVALID_ARGUMENT and reported_by is None
        details = (error.details() or "") if isinstance(error, grpc.RpcError) else error
        # What the client reads names workers by id; network addresses (the worker's, and those its
        # report names: a KV source's, gRPC's "ipv4:..." peers) are for the router's log.
        head = f"{step} on {worker.role} worker {worker.worker_id} failed: {self.code.name}: "
        super().__init__(head + _NETWORK_ADDRESS.sub("<address>", details.replace(worker.address, "<address>")))
        self.logged = f"{head}{details} (worker address {worker.address})"


@dataclass(frozen=True)
class Plan:
    prefill: WorkerView | None  # None: an aggregated worker prefills and decodes
    decode: WorkerView
    blocks: int  # the prompt's: counted into its workers' loads until their heartbeats do

    def worker_ids(self) -> set[str]:
        return {self.decode.worker_id} | ({self.prefill.worker_id} if self.prefill else set())


def client_code(code: grpc.StatusCode) -> grpc.StatusCode:
    """What the client is told of a worker's failure: a deadline or a full worker as they are (the
    client may wait, or retry later), anything else as the cluster being unavailable."""
    kept = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)
    return code if code in kept else grpc.StatusCode.UNAVAILABLE


def culprit(e: grpc.RpcError, plan: Plan) -> WorkerView:
    """The worker to avoid on the retry: the prefill worker if the decode worker names it as the
    KV source that failed (it died after prefilling, or its handle was unfit), else the decode worker."""
    failed_source = dict(e.trailing_metadata() or ()).get(rpc.FAILED_KV_SOURCE_METADATA_KEY)
    if plan.prefill is not None and failed_source == plan.prefill.worker_id:
        return plan.prefill
    return plan.decode
