"""A Generate call made from inside the router's process: the OpenAI front calls the router's
own RouterServicer, the same code every gRPC client reaches, without serializing the request,
a loopback connection and a gRPC server thread per message in between (that hop was most of
the front's cost: BENCHMARKS, "The OpenAI HTTP front").

`LocalContext` is the part of grpc.ServicerContext the servicer uses; `LocalCall` runs the
servicer's generator in a thread of its own (as the gRPC server would) and hands each message to
the caller's event loop, with the interface of a grpc.aio call: `read()`, `cancel()`, and
failures as grpc.RpcError with code(), details() and trailing_metadata().
"""

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import grpc

from proto.pdspec.v1 import router_pb2

NO_DEADLINE_S = 1e9  # what time_remaining() says without one (grpc's is as large)


class LocalAbort(grpc.RpcError):
    """How a call ended other than by its last message: the status a gRPC client would get."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: Sequence[tuple[str, str]] = ()):
        super().__init__(details)
        self._code, self._details, self._trailing = code, details, tuple(trailing)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing


class LocalContext:
    """The call's end (its last message, the caller's cancel, or the deadline) runs the
    callbacks once, as gRPC runs them when an RPC terminates."""

    def __init__(self, metadata: Sequence[tuple[str, str]], timeout_s: float | None):
        self._metadata = tuple(metadata)
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] | None = []
        self._code: grpc.StatusCode | None = None
        self.trailing: tuple[tuple[str, str], ...] = ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float:
        return NO_DEADLINE_S if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    def is_active(self) -> bool:
        return self._callbacks is not None and self.time_remaining() > 0

    def expired(self) -> bool:
        """The deadline has passed (the servicer may have noticed before the caller's timer)."""
        return self._deadline is not None and time.monotonic() >= self._deadline

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._callbacks is None:
                return False
            self._callbacks.append(callback)
            return True

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.trailing = tuple(metadata)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._code = code
        raise LocalAbort(code, details, self.trailing)

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def cancel(self) -> None:
        """As grpc's: end the call now. Only the router's watchdog cancels a context, on a call past
        the router's deadline: it ends timed out (a gRPC client sees CANCELLED; an HTTP one got the
        stream's quiet end, a 502)."""
        self.end(grpc.StatusCode.DEADLINE_EXCEEDED)

    def end(self, code: grpc.StatusCode | None = None) -> None:
        """The call is over (`code`: how, when the caller or the deadline ended it)."""
        with self._lock:
            callbacks, self._callbacks = self._callbacks, None
            if callbacks is not None and self._code is None:
                self._code = code
        for callback in callbacks or ():
            callback()


_END = object()


def _timed_out() -> LocalAbort:
    return LocalAbort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's timeout passed")


class LocalCall:
    """One Generate of `generate(request, context)` (RouterServicer.Generate), consumed from an
    asyncio loop; the deadline and cancel() end it as they end a gRPC call."""

    def __init__(self, generate: Callable[[router_pb2.GenerateRequest, LocalContext],
                                          Iterator[router_pb2.GenerateResponse]],
                 request: router_pb2.GenerateRequest, metadata: Sequence[tuple[str, str]] = (),
                 timeout: float | None = None):
        self._context = LocalContext(metadata, timeout)
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._timer = self._loop.call_later(timeout, self._expire) if timeout is not None else None
        threading.Thread(target=self._produce, args=(generate, request), name="http-generate", daemon=True).start()

    async def read(self) -> router_pb2.GenerateResponse:
        """The next message; raises LocalAbort if the call failed, was cancelled or ran out of time."""
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)  # every later read sees the end too
            return grpc.aio.EOF
        if isinstance(item, LocalAbort):
            self._queue.put_nowait(item)
            raise item
        return item

    def cancel(self) -> None:
        """The client left: the router stops the request (a no-op once the call is over)."""
        self._fail(LocalAbort(grpc.StatusCode.CANCELLED, "the client left"))

    def _expire(self) -> None:
        self._fail(_timed_out())

    def _fail(self, error: LocalAbort) -> None:
        if self._context.is_active() or error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            self._queue.put_nowait(error)  # ahead of whatever the servicer still sends
        self._context.end(error.code())

    def _produce(self, generate, request) -> None:
        """In its own thread: every message, then the end (or how the call failed)."""
        stream = generate(request, self._context)
        try:
            for message in stream:
                if not self._context.is_active():
                    break
                self._to_loop(self._queue.put_nowait, message)
            # A stream that stops at the deadline ends as a gRPC call's would, in DEADLINE_EXCEEDED,
            # even when the servicer saw the time run out before the caller's timer fired.
            ended_late = self._context.expired() or self._context.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            self._to_loop(self._queue.put_nowait, _timed_out() if ended_late else _END)
        except LocalAbort as e:
            self._to_loop(self._queue.put_nowait, e)
        except Exception as e:  # a bug in the servicer: INTERNAL, as the gRPC server would answer
            self._to_loop(self._queue.put_nowait, LocalAbort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"))
        finally:
            stream.close()  # a call ended early: the servicer's cleanup runs now, not at collection
            self._context.end()
            if self._timer is not None:
                self._to_loop(self._timer.cancel)

    def _to_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the caller's loop has closed (the server is stopping): nobody reads
            pass
