"""router/local_call.py: an in-process Generate ends as a gRPC call ends. Its messages arrive in
order then EOF; abort is the status; the deadline and the caller's cancel end it with their
status, run the context's callbacks once and close the generator (its cleanup runs at once).
The HTTP tests (tests/test_http_api.py, test_admission.py) drive it through the real router."""

import asyncio
import threading
import time

import grpc
import pytest

from proto.pdspec.v1 import router_pb2
from router.local_call import LocalAbort, LocalCall


def _run(coroutine):
    return asyncio.run(coroutine)


def test_messages_then_eof_and_an_abort_as_its_status():
    def generate(request, context):
        yield router_pb2.GenerateResponse(text="a")
        yield router_pb2.GenerateResponse(text="b", finish_reason="stop")

    async def read_all():
        call = LocalCall(generate, router_pb2.GenerateRequest())
        return [await call.read() for _ in range(3)]

    a, b, end = _run(read_all())
    assert (a.text, b.finish_reason, end) == ("a", "stop", grpc.aio.EOF)

    def refuse(request, context):
        context.set_trailing_metadata((("retry-after", "3"),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        yield  # a generator, as the servicer's Generate is

    async def read_refused():
        return await LocalCall(refuse, router_pb2.GenerateRequest()).read()

    with pytest.raises(LocalAbort) as e:
        _run(read_refused())
    assert (e.value.code(), e.value.details(), e.value.trailing_metadata()) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, "full", (("retry-after", "3"),))


@pytest.mark.parametrize("ending", ["deadline", "cancel"])
def test_the_deadline_or_a_cancel_ends_the_call_runs_its_callbacks_and_closes_the_generator(ending):
    ended, closed, released = [], threading.Event(), threading.Event()

    def generate(request, context):
        context.add_callback(lambda: ended.append(context.code()))
        try:
            yield router_pb2.GenerateResponse(text="first")
            released.wait(10)  # a worker that keeps the stream open until the call is over
            yield router_pb2.GenerateResponse(text="late")
        finally:
            closed.set()

    async def drive():
        call = LocalCall(generate, router_pb2.GenerateRequest(), timeout=0.2 if ending == "deadline" else None)
        first = await call.read()
        if ending == "cancel":
            call.cancel()
        with pytest.raises(LocalAbort) as e:
            await call.read()
        released.set()
        return first, e.value.code()

    first, code = _run(drive())
    expected = grpc.StatusCode.DEADLINE_EXCEEDED if ending == "deadline" else grpc.StatusCode.CANCELLED
    assert first.text == "first" and code == expected
    assert closed.wait(10) and ended == [expected]


def test_a_stream_that_stops_at_its_deadline_ends_in_deadline_exceeded():
    """The servicer may see the time run out (and end its stream quietly) before the caller's
    timer fires: the caller still gets DEADLINE_EXCEEDED, as from a gRPC call, never a bare EOF."""
    def generate(request, context):
        while context.is_active():
            threading.Event().wait(0.01)
        return
        yield  # a generator, as the servicer's Generate is

    async def read_late():
        call = LocalCall(generate, router_pb2.GenerateRequest(), timeout=0.05)
        time.sleep(0.3)  # the loop is busy: the producer's end is queued before the timer runs
        return await call.read()

    with pytest.raises(LocalAbort) as e:
        _run(read_late())
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_call_the_routers_watchdog_cancels_ends_timed_out():
    """Past the router's own deadline its watchdog cancels the context: the stream ended quietly
    (the servicer's abort message dropped), and the HTTP client got a 502 for a timeout."""
    def generate(request, context):
        yield router_pb2.GenerateResponse(text="first")
        while context.is_active():
            threading.Event().wait(0.01)
        yield router_pb2.GenerateResponse(finish_reason="abort")  # as _relay's after its stream was cancelled

    async def drive():
        call = LocalCall(generate, router_pb2.GenerateRequest())
        await call.read()
        call._context.cancel()  # what the watchdog calls
        with pytest.raises(LocalAbort) as e:
            await call.read()
        return e.value.code()

    assert _run(drive()) == grpc.StatusCode.DEADLINE_EXCEEDED
