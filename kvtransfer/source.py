"""The source side of a KV transfer: pin a prefilled request's blocks and serve them.

A pin ends exactly once, and then calls its `on_release` (the engine frees the blocks): on a
Release RPC, when it times out (the reaper thread), or at release_all()/close(). A PullBlocks
read holds its pin's blocks while it copies one (outside the lock: a device cache's copy waits
on the engine's queued kernels, and pins, releases and other reads must not wait on it); a pin
ended meanwhile calls on_release when its last read is done, so no bytes are sent of a block
the engine may already have reused.
"""

import collections
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import torch
import xxhash

from engine.kv_layout import KVLayout, KVLayoutMismatch
from kvtransfer.layout import check_caches, layout_from_proto, read_block
from proto.pdspec.v1 import kv_pb2, kv_pb2_grpc

if TYPE_CHECKING:
    from kvtransfer.nixl_backend import NixlMemory

log = logging.getLogger(__name__)

SERVICE_NAME = kv_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name
# A slot a PullBlocks call holds while it streams (a context manager per call), refusing the call
# past its limit.
PullSlots = Callable[[grpc.ServicerContext], AbstractContextManager[None]]


@dataclass(frozen=True)
class _Pin:
    pin_id: str
    block_ids: frozenset[int]
    on_release: Callable[[], None]
    deadline: float  # time.monotonic()
    ended: threading.Event = field(default_factory=threading.Event, compare=False)  # on_release has run


class KVSource:
    """Pins of one worker's KV cache blocks, served by `self.servicer` (register it, with the
    cluster token, on the worker's internal gRPC server). With `nixl`, the caches are registered
    with a NIXL agent once, here, so destinations can READ them directly."""

    def __init__(self, layout: KVLayout, caches: dict[str, torch.Tensor], pin_timeout_s: float, nixl: bool,
                 token: str | None = None, pull_slots: PullSlots | None = None):
        """token: the cluster token, which NIXL requires (see kvtransfer/nixl_backend.py).
        pull_slots: held by each PullBlocks stream while it runs (None: any number run at once);
        past its limit it refuses the call with RESOURCE_EXHAUSTED, which the puller waits out
        (serving's kv_pull_limit). Each stream holds a server thread: unbounded, several decode
        workers' pulls took every thread, and health checks and Release calls queued behind them
        (the router's probe evicted the worker, pins lapsed)."""
        check_caches(layout, caches)
        self.layout, self.caches, self.pin_timeout_s = layout, caches, pin_timeout_s
        self.nixl = _nixl_memory(layout, caches, token) if nixl else None
        self.servicer = KVTransferServicer(self, pull_slots)
        # Insertion order is deadline order: every pin gets the same timeout on a monotonic clock.
        self._pins: dict[str, _Pin] = {}
        self._reads: collections.Counter[str] = collections.Counter()  # pin id -> block copies under way
        self._ended_mid_read: dict[str, tuple[str, _Pin]] = {}  # pin id -> (request id, pin): ends after them
        self._lock = threading.Condition()
        self._closed = False
        self._reaper = threading.Thread(target=self._reap, name="kv-pin-reaper", daemon=True)
        self._reaper.start()

    def pin(self, request_id: str, block_ids: list[int], on_release: Callable[[], None]) -> str:
        """Pin the request's blocks; returns the pin's id, which the handle carries: a retry of the
        request id gets another, so an earlier attempt's late Release cannot end it."""
        with self._lock:
            if self._closed:
                raise RuntimeError("KVSource is closed: no new pins during shutdown")
            if request_id in self._pins:
                raise ValueError(f"request {request_id} is already pinned: request ids must be unique")
            pin_id = uuid.uuid4().hex
            self._pins[request_id] = _Pin(pin_id, frozenset(block_ids), on_release,
                                          time.monotonic() + self.pin_timeout_s)
            self._lock.notify()  # the reaper may be sleeping without a deadline
            return pin_id

    def release(self, request_id: str, pin_id: str = "", wait_s: float = 0.0) -> bool:
        """End the pin now (`pin_id`: only that pin; empty: the request's); False if it had already
        ended (or never existed). A block copy under way ends it when done; `wait_s`: wait that long
        at most for it (and its on_release), where the caller's next step needs the blocks freed."""
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is None or pin_id not in ("", pin.pin_id):
                return False
            del self._pins[request_id]
            now = self._ending([(request_id, pin)])
        _end_all(now)
        if not now and wait_s and not pin.ended.wait(wait_s):
            log.warning("the pin of %s still waits on a block copy after %.0f s", request_id, wait_s)
        return True

    def release_all(self) -> None:
        with self._lock:
            pins, self._pins = self._pins, {}
            now = self._ending(list(pins.items()))
        _end_all(now)

    def _ending(self, ended: list[tuple[str, _Pin]]) -> list[tuple[str, _Pin]]:
        """Of pins just taken out of `_pins` (under the lock), those to end now; the others end
        when their last read is done."""
        now = []
        for request_id, pin in ended:
            if self._reads[pin.pin_id]:
                self._ended_mid_read[pin.pin_id] = (request_id, pin)
            else:
                now.append((request_id, pin))
        return now

    def close(self) -> None:
        """Stop the reaper, end every pin, unregister from NIXL. Stop the gRPC server first."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._reaper.join()
        self.release_all()
        if self.nixl is not None:
            self.nixl.close()

    def pinned(self, request_id: str, pin_id: str = "") -> frozenset[int] | None:
        """The blocks of the request's pin (`pin_id`: that pin only; empty: any), None if none."""
        with self._lock:
            pin = self._pins.get(request_id)
        return pin.block_ids if pin is not None and pin_id in ("", pin.pin_id) else None

    def read_pinned(self, request_id: str, pin_id: str, cache: str, block_id: int) -> bytes | None:
        """The block's bytes, or None if the request's pin (`pin_id`, or any) does not (or no
        longer) hold it."""
        with self._lock:
            pin = self._pins.get(request_id)
            if pin is None or pin_id not in ("", pin.pin_id) or block_id not in pin.block_ids:
                return None
            self._reads[pin.pin_id] += 1
        try:
            return read_block(self.caches[cache], block_id)
        finally:
            with self._lock:
                self._reads[pin.pin_id] -= 1
                last = not self._reads[pin.pin_id]
                if last:
                    del self._reads[pin.pin_id]
                ended = self._ended_mid_read.pop(pin.pin_id, None) if last else None
            _end_all([ended] if ended else [])

    def _reap(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                expired = []
                for request_id, pin in self._pins.items():
                    if pin.deadline > now:
                        break
                    expired.append(request_id)
                if not expired:
                    first = next(iter(self._pins.values()), None)
                    self._lock.wait(first.deadline - now if first else None)
                    continue
                pins = [(request_id, self._pins.pop(request_id)) for request_id in expired]
                now = self._ending(pins)
            for request_id, _ in pins:
                log.warning("pin of %s timed out after %gs: no decode worker released it", request_id,
                            self.pin_timeout_s)
            _end_all(now)


def _nixl_memory(layout: KVLayout, caches: dict[str, torch.Tensor], token: str | None) -> "NixlMemory":
    # Imported only when used: NIXL's bundled protobuf/gRPC libraries crash any process that also
    # loads grpc_tools' protoc (in either order), and a gRPC-only worker need not risk it.
    from kvtransfer.nixl_backend import NixlMemory
    return NixlMemory("kvsource", layout, caches, token)


def _end_all(pins: list[tuple[str, _Pin]]) -> None:
    for request_id, pin in pins:
        try:
            pin.on_release()
        except Exception:  # one failing callback must not stop the reaper or the other releases
            log.exception("on_release of %s failed", request_id)
        finally:
            pin.ended.set()


class KVTransferServicer(kv_pb2_grpc.KVTransferServicer):
    def __init__(self, source: KVSource, pulls: PullSlots | None = None):
        self.source, self.pulls = source, pulls

    def PullBlocks(self, request: kv_pb2.PullBlocksRequest,
                   context: grpc.ServicerContext) -> Iterator[kv_pb2.KVBlockChunk]:
        with self.pulls(context) if self.pulls is not None else contextlib.nullcontext():
            yield from self._pull(request, context)

    def _pull(self, request: kv_pb2.PullBlocksRequest,
              context: grpc.ServicerContext) -> Iterator[kv_pb2.KVBlockChunk]:
        try:
            self.source.layout.check_compatible(layout_from_proto(request.expected_layout))
        except KVLayoutMismatch as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        rid = request.request_id
        pinned = self.source.pinned(rid, request.pin_id)
        if pinned is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"request {rid} is not pinned here (released or timed out)")
        outside = sorted(set(request.block_ids) - pinned)
        if outside:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"blocks {outside} are not pinned for request {rid}")
        for block_id in request.block_ids:
            for cache in self.source.caches:
                yield self.chunk(rid, request.pin_id, block_id, cache, context)

    def chunk(self, request_id: str, pin_id: str, block_id: int, cache: str,
              context: grpc.ServicerContext) -> kv_pb2.KVBlockChunk:
        data = self.source.read_pinned(request_id, pin_id, cache, block_id)
        if data is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"request {request_id} was released or timed out during the fetch")
        return kv_pb2.KVBlockChunk(block_id=block_id, cache=cache, data=data, checksum=xxhash.xxh3_64_intdigest(data))

    def GetNixlMetadata(self, request: kv_pb2.NixlMetadataRequest,
                        context: grpc.ServicerContext) -> kv_pb2.NixlMetadataResponse:
        if self.source.nixl is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker serves KV without NIXL: "
                          "use kv_transfer grpc on the decode side, or enable nixl here")
        return self.source.nixl.metadata()

    def Release(self, request: kv_pb2.ReleaseRequest, context: grpc.ServicerContext) -> kv_pb2.ReleaseResponse:
        return kv_pb2.ReleaseResponse(found=self.source.release(request.request_id, request.pin_id))
