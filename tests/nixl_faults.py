"""The NIXL faults the destination process of tests/kv_peers.py injects on purpose, each while one
pull runs: READs that fail and cannot be released, READs that never end, agents NIXL refuses to
drop, and a pull cancelled as soon as its READ is posted."""

import contextlib
import time
from unittest import mock

import torch

from kvtransfer.connector import Cancellation, KVTransferError
from proto.pdspec.v1 import kv_pb2


@contextlib.contextmanager
def _unstoppable_reads():
    """Faults on purpose: NIXL starts each READ, then reports an error and refuses to cancel it.
    Afterwards the READs are really released."""
    from nixl_cu12._api import nixl_agent, nixl_xfer_handle
    from kvtransfer.nixl_backend import nixl_bindings
    started, transfer, release = [], nixl_agent.transfer, nixl_xfer_handle.release

    def failing_transfer(agent, xfer, *args, **kwargs):
        transfer(agent, xfer, *args, **kwargs)
        started.append(xfer)
        raise nixl_bindings.nixlBackendError("injected: the READ stalled")

    def refusing_release(xfer):
        raise nixl_bindings.nixlBackendError("injected: it cannot be cancelled")

    with mock.patch.object(nixl_agent, "transfer", failing_transfer), \
            mock.patch.object(nixl_xfer_handle, "release", refusing_release):
        yield
    for xfer in started:
        release(xfer)


@contextlib.contextmanager
def _stuck_reads():
    """Faults on purpose: NIXL reports every READ in progress for good (it never ends)."""
    from nixl_cu12._api import nixl_agent

    with mock.patch.object(nixl_agent, "check_xfer_state", lambda agent, xfer: "PROC"), \
            mock.patch.object(nixl_agent, "transfer", lambda agent, xfer, *args, **kwargs: "PROC"):
        yield


REFUSED_REMOVALS: list[str] = []  # the agents NIXL was asked to drop under "refused-removal"


@contextlib.contextmanager
def _refused_removals():
    """Faults on purpose: NIXL refuses to drop any remote agent (each request is counted)."""
    from nixl_cu12._api import nixl_agent
    from kvtransfer.nixl_backend import nixl_bindings

    def refusing_remove(agent, name):
        REFUSED_REMOVALS.append(name)
        raise nixl_bindings.nixlBackendError("injected: the agent is busy")

    with mock.patch.object(nixl_agent, "remove_remote_agent", refusing_remove):
        yield


FAULTS = {None: contextlib.nullcontext, "unstoppable": _unstoppable_reads, "stuck": _stuck_reads,
           "refused-removal": _refused_removals}


def late_writes(connector, caches: dict[str, torch.Tensor], handle: bytes, remote: list[int], local_ids: list[int],
                timeout_s: float) -> tuple[tuple | None, str | None, bool]:
    """A NIXL pull cancelled as soon as its READ is posted (the fault: the cancel's timing): its
    outcome, what NIXL said as it posted the READ ("PROC": under way), and whether the local
    blocks changed in the 0.3 s after the pull ended."""
    from nixl_cu12._api import nixl_agent

    cancel, posted, transfer = Cancellation(), [], nixl_agent.transfer

    def transfer_then_cancel(agent, xfer, *args, **kwargs):
        posted.append(transfer(agent, xfer, *args, **kwargs))
        cancel.set()
        return posted[-1]

    outcome = None
    with mock.patch.object(nixl_agent, "transfer", transfer_then_cancel):
        try:
            connector.pull(kv_pb2.KVHandle.FromString(handle), remote, local_ids, timeout_s, cancel)
        except KVTransferError as e:
            outcome = (str(e), e.retryable, e.may_still_write)
    ended = {name: t.clone() for name, t in caches.items()}
    time.sleep(0.3)
    return outcome, posted[0] if posted else None, any(not torch.equal(ended[n], t) for n, t in caches.items())
