"""The destination side of a KV transfer: one interface, two backends (NIXL, gRPC), and what
the backends share (checks, Release, channels, errors). `kvtransfer.backends` picks one.

Ownership: the source keeps a request's blocks pinned until the destination calls Release or
the pin times out. `pull` always ends with a Release (best effort, also when it fails), so the
source never waits for the timeout on a pull that was tried. The destination's local blocks stay
its own: when `pull` raises, its caller frees the blocks it had allocated for the request (their
contents are undefined), unless the error says a transfer may still write into them (a NIXL READ
that could not be cancelled): then they must never be used again. `pull` writes to no other
local block.

A failure is `retryable` when trying the request again (a new prefill, maybe on another
worker) can succeed: source gone or slow, pin expired, corrupted bytes. It is not when the
deployment is wrong (cluster token, KV layout) or the caller passed bad block ids.
"""

import abc
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import grpc
import torch

from engine.kv_layout import KVLayout, KVLayoutMismatch
from kvtransfer.layout import block_checksums, check_caches, layout_from_proto
from proto.pdspec.v1 import kv_pb2, kv_pb2_grpc
from proto.rpc import channel
from proto.tls import Tls, current

log = logging.getLogger(__name__)

RELEASE_MIN_TIMEOUT_S = 1.0  # a Release after a timed-out pull still gets this long to unpin promptly
CLOSE_WAIT_S = 10.0  # close() waits this long for cancelled pulls to end (their Release included)
SOURCE_IDLE_S = 600.0  # a source no pull used this long is let go (its channel, its NIXL agent)
_NOT_RETRYABLE = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                  grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
                  grpc.StatusCode.UNIMPLEMENTED}
_HINTS = {
    grpc.StatusCode.UNAUTHENTICATED: "give both workers the same cluster token",
    grpc.StatusCode.PERMISSION_DENIED: "the handle lists blocks the source did not pin for this request",
    grpc.StatusCode.FAILED_PRECONDITION: "run prefill and decode workers with the same model, dtype, block size, draft",
    grpc.StatusCode.NOT_FOUND: "the source no longer holds the blocks (released or pin timed out): prefill again",
    grpc.StatusCode.UNAVAILABLE: "prefill again, on another worker if the source stays unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the source was too slow (a pull gets 30 s and the request's deadline at "
                                       "most): prefill again, on a less loaded worker",
}


class KVTransferError(RuntimeError):
    def __init__(self, message: str, retryable: bool, may_still_write: bool = False):
        super().__init__(message)
        self.retryable = retryable
        self.may_still_write = may_still_write  # into the pull's local blocks: never reuse them


class Cancellation:
    """A pull's stop signal, set once from any thread (its request's client gone, the worker
    closing): a gRPC stream is cancelled at once, a NIXL READ at its next poll, a wait for a busy
    source cut short; the pull then raises KVTransferError, its Release still sent. Without it a
    cancelled request's pull ran on for up to its timeout, holding one of the source's pull slots,
    its pin and its local blocks."""

    def __init__(self) -> None:
        self._set = threading.Event()
        self._lock = threading.Lock()
        self._hooks: list[Callable[[], None]] = []

    def set(self) -> None:
        with self._lock:
            self._set.set()
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()

    def is_set(self) -> bool:
        return self._set.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`, less if set; whether it is."""
        return self._set.wait(seconds)

    def on_set(self, hook: Callable[[], None]) -> None:
        """Run `hook` once set (now, if it is)."""
        with self._lock:
            if not self._set.is_set():
                self._hooks.append(hook)
                return
        hook()


class KVConnector(Protocol):
    def pull(self, handle: kv_pb2.KVHandle, remote_block_ids: list[int], local_block_ids: list[int],
             timeout_s: float, cancel: Cancellation | None = None) -> None:
        """Copy the source's blocks `remote_block_ids` (target and draft caches) of the request in
        `handle` into the local blocks `local_block_ids` (same order), then release the source's
        pin; `cancel` stops it early. Raises KVTransferError; see the module docstring for who
        frees what."""

    def close(self) -> None:
        """Cancel running pulls and wait for them (bounded), refuse new ones, close channels and
        NIXL registrations."""


def rpc_failure(e: grpc.RpcError, call: str, source: str) -> KVTransferError:
    code = e.code()
    hint = f" ({_HINTS[code]})" if code in _HINTS else ""
    return KVTransferError(f"{call} to {source} failed: {code.name}: {e.details()}{hint}",
                           retryable=code not in _NOT_RETRYABLE)


def check_layout(local: KVLayout, remote: kv_pb2.KVLayout, source: str) -> None:
    try:
        local.check_compatible(layout_from_proto(remote))
    except KVLayoutMismatch as e:
        raise KVTransferError(f"{e} (source {source}): {_HINTS[grpc.StatusCode.FAILED_PRECONDITION]}",
                              retryable=False) from None


def remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


class PerSource(Protocol):
    """What a connector keeps per source (a channel, a NIXL agent) and lets go when idle."""
    users: int  # pulls using it now
    last_used: float  # time.monotonic() when the last one ended


def idle(entry: PerSource, now: float) -> bool:
    """No pull uses it, nor has for SOURCE_IDLE_S."""
    return entry.users == 0 and now - entry.last_used > SOURCE_IDLE_S


class BaseConnector(abc.ABC):
    """Checks, Release and channels shared by the backends; each moves the bytes in `_move`."""

    # Whether only the final Release (found=True) proves the bytes read were the pin's: a one-sided
    # READ's are (NIXL); a source that copies each block while its pin holds it proves it per block.
    needs_release_proof = True

    def __init__(self, layout: KVLayout, caches: dict[str, torch.Tensor], token: str | None, tls: Tls | None = None):
        check_caches(layout, caches)
        self.layout, self.caches, self.token, self.tls = layout, caches, token, tls
        self.block_bytes = {name: layout.block_bytes(shape) for name, shape in layout.caches().items()}
        # By source address and the identity it presents: the channel, pulls using it now, when the
        # last one ended. Sources come and go (a restarted pod has a new address), certificates are
        # renewed (a new identity, a new channel): one unused for SOURCE_IDLE_S is closed.
        self._channels: dict[tuple[str, Tls | None], _Channel] = {}
        self._channels_lock = threading.Lock()
        self._unchecked_said = False  # warned that blocks go unchecked (either side's caches in device memory)
        self._pulls = threading.Condition()  # guards the running pulls' cancellations and _closing
        self._running: set[Cancellation] = set()
        self._closing = False

    def pull(self, handle: kv_pb2.KVHandle, remote_block_ids: list[int], local_block_ids: list[int],
             timeout_s: float, cancel: Cancellation | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        cancel = cancel or Cancellation()
        with self._pulls:
            if self._closing:
                raise KVTransferError(f"pull of {handle.request_id} refused: this worker is shutting down",
                                      retryable=True)
            self._running.add(cancel)
        try:
            self._pull(handle, remote_block_ids, local_block_ids, deadline, cancel)
        finally:
            with self._pulls:
                self._running.discard(cancel)
                self._pulls.notify_all()

    def _pull(self, handle: kv_pb2.KVHandle, remote_block_ids: list[int], local_block_ids: list[int],
              deadline: float, cancel: Cancellation) -> None:
        used = self._use_channel(handle.source_address)
        stub = kv_pb2_grpc.KVTransferStub(used.channel)
        try:
            self._check(handle, remote_block_ids, local_block_ids)
            if remote_block_ids:
                self._move(stub, handle, remote_block_ids, local_block_ids, deadline, cancel)
        finally:
            found = self._release(stub, handle, deadline, cancel)
            with self._channels_lock:
                used.users -= 1
                used.last_used = time.monotonic()
                if used.closing and not used.users:
                    used.channel.close()
        if not found and self.needs_release_proof:
            # Only a pin held until now proves the source did not reuse the blocks while we read them.
            reason = "Release failed" if found is None else "it was no longer pinned: its pin timed out"
            raise KVTransferError(f"{handle.source_address} did not confirm that {handle.request_id} stayed pinned "
                                  f"through the transfer ({reason}): prefill it again", retryable=True)
        self._check_pinned_contents(handle, remote_block_ids, local_block_ids)

    def _check_pinned_contents(self, handle: kv_pb2.KVHandle, remote: list[int], local: list[int]) -> None:
        """The blocks written hold what the source pinned (its checksums, when it sent them)."""
        names = list(self.layout.caches())
        expected = list(handle.block_checksums)
        if not remote:
            return
        if not expected:
            if not self._unchecked_said:  # a source's caches in device memory: it hashed none
                self._unchecked_said = True
                log.warning("KV blocks from %s came without checksums (its caches are in device memory): pulled "
                            "blocks are not checked end to end", handle.source_address)
            return
        if len(expected) != len(names) * len(handle.block_ids):
            raise KVTransferError(f"{handle.source_address} sent {len(expected)} block checksums for "
                                  f"{len(handle.block_ids)} blocks of {len(names)} caches", retryable=False)
        at = {b: i for i, b in enumerate(handle.block_ids)}
        wanted = [expected[c * len(handle.block_ids) + at[b]] for c in range(len(names)) for b in remote]
        got = block_checksums(self.caches, names, local)
        if not got and not self._unchecked_said:  # our caches are in device memory: not hashed here
            self._unchecked_said = True
            log.warning("KV blocks pulled into device memory are not checked against their sources' checksums "
                        "(hashing them would copy every block to the host)")
        if got not in ([], wanted):
            raise KVTransferError(f"the KV of {handle.request_id} pulled from {handle.source_address} does not match "
                                  "the checksums of its pinned blocks: corrupted on the way, or changed under its pin",
                                  retryable=True)

    def close(self) -> None:
        self._stop_pulls()
        self._close_channels()

    def _stop_pulls(self) -> bool:
        """Refuse new pulls, cancel the running ones and wait for them (a closed NIXL registration
        under a READ still writing is undefined behaviour in UCX); whether they all ended."""
        with self._pulls:
            self._closing = True
            running = list(self._running)
        for cancel in running:
            cancel.set()
        with self._pulls:
            if self._pulls.wait_for(lambda: not self._running, timeout=CLOSE_WAIT_S):
                return True
            log.error("%d KV pulls still run %.0fs after they were cancelled", len(self._running), CLOSE_WAIT_S)
            return False

    def _close_channels(self) -> None:
        """Close every channel; one a pull still uses (one close() gave up waiting for), once that pull
        leaves it: a call on a closed channel through the cluster token's interceptor crashed the
        process (grpc 1.85), where the pull's Release expected a ValueError."""
        with self._channels_lock:
            for used in self._channels.values():
                used.closing = True
                if not used.users:
                    used.channel.close()
            self._channels.clear()

    @abc.abstractmethod
    def _move(self, stub: kv_pb2_grpc.KVTransferStub, handle: kv_pb2.KVHandle, remote_block_ids: list[int],
              local_block_ids: list[int], deadline: float, cancel: Cancellation) -> None:
        """Copy the blocks (every cache) by `deadline` (time.monotonic()), unless `cancel` is set
        first; raise KVTransferError."""

    def _use_channel(self, address: str) -> "_Channel":
        """The source's channel, counted as in use until the pull ends; idle ones closed."""
        now = time.monotonic()
        with self._channels_lock:
            for gone in [a for a, c in self._channels.items() if idle(c, now)]:
                self._channels.pop(gone).channel.close()
            self.tls = current(self.tls)
            key = (address, self.tls)
            if key not in self._channels:
                self._channels[key] = _Channel(channel(address, self.token, self.tls))
            used = self._channels[key]
            used.users += 1
            return used

    def _check(self, handle: kv_pb2.KVHandle, remote: list[int], local: list[int]) -> None:
        """Reject, before any byte moves, a handle of another layout or block ids that do not fit."""
        check_layout(self.layout, handle.layout, handle.source_address)
        num_local = next(iter(self.caches.values())).shape[0]
        checks = [
            (len(remote) != len(local), "remote and local block id lists differ in length"),
            (len(set(remote)) != len(remote), "remote block ids repeat"),
            (len(set(local)) != len(local), "local block ids repeat"),
            (not set(remote) <= set(handle.block_ids), "remote block ids are not all in the handle's block_ids"),
            (any(not 0 <= b < num_local for b in local), f"local block ids are outside [0, {num_local})"),
        ]
        for failed, problem in checks:
            if failed:
                raise KVTransferError(f"pull of {handle.request_id}: {problem} (remote {remote}, local {local})",
                                      retryable=False)

    def _release(self, stub: kv_pb2_grpc.KVTransferStub, handle: kv_pb2.KVHandle, deadline: float,
                 cancel: Cancellation) -> bool | None:
        """Ask the source to unpin; whether it still held the pin, None if it could not be asked.
        Once the pull is cancelled the Release gets RELEASE_MIN_TIMEOUT_S at most: waiting on a stalled
        source until the pull's deadline held the cancelled request's thread, call slot and blocks
        (and a closing worker) that long, where a Release lost only leaves the pin to time out."""
        timeout = RELEASE_MIN_TIMEOUT_S if cancel.is_set() else max(remaining(deadline), RELEASE_MIN_TIMEOUT_S)
        release = kv_pb2.ReleaseRequest(request_id=handle.request_id, pin_id=handle.pin_id)
        call = stub.Release.future(release, timeout=timeout)  # (its channel stays open while the pull runs)
        if not cancel.is_set():  # cancelled while it waits: RELEASE_MIN_TIMEOUT_S more (it may be on its way)
            cancel.on_set(lambda: call.done() or _cancel_later(call, RELEASE_MIN_TIMEOUT_S))  # every stream's end sets it
        try:
            return call.result().found
        except grpc.FutureCancelledError:
            log.warning("Release of %s cut short: its pull was cancelled (the pin on %s times out instead)",
                        handle.request_id, handle.source_address)
            return None
        except grpc.RpcError as e:
            log.warning("%s", rpc_failure(e, f"Release of {handle.request_id}", handle.source_address))
            return None


def _cancel_later(call: grpc.Future, seconds: float) -> None:
    """Cancel `call` in `seconds` (a no-op if it is done by then)."""
    timer = threading.Timer(seconds, call.cancel)
    timer.daemon = True
    timer.start()


@dataclass
class _Channel:
    channel: grpc.Channel
    users: int = 0
    last_used: float = 0.0
    closing: bool = False  # its last user closes it (see _close_channels)
