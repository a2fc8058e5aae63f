"""When a launched cluster counts as up: the router lists every worker the launcher started.

Shared by every launcher (local processes, Ray actors); each supplies its own way of noticing
that a member died during start-up, so a crash fails fast instead of waiting out the timeout.
"""

import time
from collections.abc import Callable, Collection

import grpc

from proto import rpc
from proto.pdspec.v1 import router_pb2, router_pb2_grpc
from proto.tls import Tls


def list_workers(router_address: str, token: str | None, tls: Tls | None = None) -> dict[str, router_pb2.WorkerStatus]:
    """The workers the router lists, by id. ListWorkers hands out internal addresses, so it needs
    the cluster `token`."""
    with rpc.channel(router_address, token, tls) as ch:
        workers = router_pb2_grpc.RouterStub(ch).ListWorkers(router_pb2.ListWorkersRequest(), timeout=5).workers
    return {w.worker_id: w for w in workers}


def wait_for_workers(router_address: str, token: str | None, expected: Collection[str], timeout_s: float,
                     check_alive: Callable[[], None], hint: str = "", tls: Tls | None = None) -> None:
    """Poll the router's ListWorkers (with the cluster `token`) until every id in `expected` is listed.

    `check_alive` runs each round and raises when a member can no longer come up; `hint` (e.g.
    where the logs are) ends the timeout message."""
    expected, listed = set(expected), set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check_alive()
        try:
            listed = set(list_workers(router_address, token, tls))
        except grpc.RpcError as e:  # a router going down (the next round's check_alive says why), or busy
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
        if expected <= listed:
            return
        time.sleep(0.5)
    raise TimeoutError(f"workers {sorted(expected - listed)} did not register in {timeout_s}s"
                       + (f"; {hint}" if hint else ""))
