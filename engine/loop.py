"""Drive an engine from its own thread so serving threads can talk to it.

Every engine call happens on the loop thread: request handlers send commands (a function and
its arguments) through a queue and wait for the result, and read each request's outputs from
the request's own queue. The engine itself stays single-threaded and lock-free; a handler
waits at most one step for its command to run.
"""

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from engine.block_manager import KVEvent
from engine.engine import Engine
from engine.output import KVHandle, RequestOutput
from engine.params import SamplingParams
from engine.stats import EngineStats

log = logging.getLogger(__name__)
STALL_LIMIT_S = 120.0  # a loop that has not come round this long is stuck in a step
FAILED_STEPS_LIMIT = 3  # this many failed steps in a row, the last of them recent, is trouble too
# Recent: a worker out of routing this long is let back to try again; longer than Kubernetes'
# liveness window (the chart's: 6 checks 10 s apart), so a poisoned one is restarted first.
FAILURE_MEMORY_S = 300.0


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.outputs: dict[str, queue.SimpleQueue[RequestOutput]] = {}
        # Appended on the loop thread, drained by the heartbeat thread: a deque needs no lock, and
        # heartbeats must not wait for a long step (the router evicts silent workers).
        self.events: collections.deque[KVEvent] = collections.deque()
        engine.blocks.subscribe(self.events.append)
        # Requests added or taken over here, for the next heartbeat to name: from then on this
        # worker's load counts them, and the router stops counting them itself. Same deque rule.
        self.arrivals: collections.deque[str] = collections.deque()
        self._commands: queue.SimpleQueue[tuple[Callable, tuple, Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self.stepped = threading.Condition()  # notified after every step (back-pressure waits on it)
        self._stopped = False
        self._stopping = threading.Lock()  # post's check and put against stop's flag
        self.progressed = time.monotonic()  # when the loop thread last came round (see trouble)
        self._failed_steps, self._failed_at = 0, 0.0  # steps failed in a row, and when the last did
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def call(self, fn: Callable, *args):
        """Run `fn(*args)` on the loop thread and return its result (or raise its exception)."""
        return self.post(fn, *args).result()

    def post(self, fn: Callable, *args) -> Future:
        """Queue `fn(*args)` for the loop thread without waiting for it (it runs before any later
        call's command); its Future holds the result or the exception."""
        future: Future = Future()
        with self._stopping:  # never queued after stop() emptied the queue: nobody would run it
            if self._stopped:
                future.set_exception(RuntimeError("the engine loop has stopped"))
                return future
            self._commands.put((fn, args, future))
        self._wake.set()
        return future

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, prefill_only: bool = False,
               outputs: queue.SimpleQueue[RequestOutput] | None = None) -> queue.SimpleQueue[RequestOutput]:
        """Queue a request and return its output queue (`outputs`, if given: a caller that made it
        first can name its attempt to `abort_attempt` before this returns); raises
        InvalidRequest/CapacityExceeded/RequestIdInUse."""
        def add():
            self.engine.add_request(prompt, params, request_id, prefill_only=prefill_only)
            self.arrivals.append(request_id)
            self.outputs[request_id] = queue.SimpleQueue() if outputs is None else outputs
            return self.outputs[request_id]

        return self.call(add)

    def take_over(self, request_id: str, prompt: list[int], params: SamplingParams) -> tuple[int, list[int]] | None:
        """Engine.take_over (a prefilled request's blocks reserved for its KV) if there is room now."""
        def take():
            reserved = self.engine.take_over(request_id, prompt, params)
            if reserved is not None:
                self.arrivals.append(request_id)
            return reserved

        return self.call(take)

    def admit_prefilled(self, request_id: str, handle: KVHandle,
                        outputs: queue.SimpleQueue[RequestOutput] | None = None) -> queue.SimpleQueue[RequestOutput]:
        """Engine.admit_prefilled; returns the request's output queue (`outputs`, as in `submit`)."""
        def admit():
            first = self.engine.admit_prefilled(request_id, handle)  # may finish it already
            mine = self.outputs[request_id] = queue.SimpleQueue() if outputs is None else outputs
            self._dispatch([first])
            return mine

        return self.call(admit)

    def abort(self, request_id: str) -> bool:
        """Abort a request (its stream gets a finished "abort" output); whether it was found."""
        return self.call(self._abort, request_id)

    def abort_attempt(self, request_id: str, outputs: queue.SimpleQueue[RequestOutput]) -> bool:
        """`abort`, if the request running under that id is the one whose output queue is
        `outputs`: a caller giving up on its attempt must not abort a later one of the same id."""
        return self.call(self._abort_attempt, request_id, outputs)

    def abort_attempt_later(self, request_id: str, outputs: queue.SimpleQueue[RequestOutput]) -> None:
        """`abort_attempt` without waiting for it (see `abort_later`)."""
        self.post_logged(f"aborting {request_id}", self._abort_attempt, request_id, outputs)

    def post_logged(self, what: str, fn: Callable, *args) -> None:
        """`post` for a command nobody waits for: its failure is logged as `what` failing."""
        def log_failure(future: Future) -> None:
            if future.exception() is not None:
                log.error("%s failed", what, exc_info=future.exception())

        self.post(fn, *args).add_done_callback(log_failure)

    def abort_later(self, request_id: str) -> None:
        """`abort` without waiting for it, for gRPC callbacks: they run on the server's one polling
        thread, and waiting out an engine step there would stall every RPC the server handles."""
        self.post_logged(f"aborting {request_id}", self._abort, request_id)

    def _abort_attempt(self, request_id: str, outputs: queue.SimpleQueue[RequestOutput]) -> bool:
        return self.outputs.get(request_id) is outputs and self._abort(request_id)

    def _abort(self, request_id: str) -> bool:
        out = self.engine.abort(request_id)
        if out is not None:
            self._dispatch([out])
        return out is not None

    def drain_events(self) -> list[KVEvent]:
        return _drain(self.events)

    def drain_arrivals(self) -> list[str]:
        return _drain(self.arrivals)

    def cache_snapshot(self) -> list[int]:
        """The prefix cache's hashes now; events queued so far are dropped (the snapshot has them)."""
        def snapshot():
            self.events.clear()
            return sorted(self.engine.blocks.cached_hashes())

        return self.call(snapshot)

    def stats(self) -> EngineStats:
        """Read without waiting for the loop thread: a heartbeat must not wait out a long step,
        and a value one step stale is as good as any for routing or a scrape."""
        return self.engine.stats()

    def trouble(self, stall_limit_s: float = STALL_LIMIT_S) -> str:
        """Why the loop cannot serve now, or "": its thread is dead, has not come round in
        `stall_limit_s` (a step that never ends: a tensor-parallel rank gone, a collective waiting
        for it), or its last FAILED_STEPS_LIMIT steps failed (a poisoned device fails them all).
        Heartbeats stop and health checks answer NOT_SERVING then, so the router routes elsewhere."""
        if not self._thread.is_alive():
            return "the engine loop's thread has died"
        if time.monotonic() - self.progressed > stall_limit_s:
            return f"the engine loop has been in one step for over {stall_limit_s:g} s"
        if self._failed_steps >= FAILED_STEPS_LIMIT and time.monotonic() - self._failed_at < FAILURE_MEMORY_S:
            return f"the engine's last {self._failed_steps} steps failed"
        return ""

    def wait_step(self, timeout: float) -> None:
        with self.stepped:
            self.stepped.wait(timeout)

    def stop(self) -> None:
        """Stop stepping. Nobody is left waiting: commands still queued fail, and every request's
        stream ends "abort" (a handler blocked on it would keep its process from exiting)."""
        with self._stopping:
            self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        self._end_waiting("abort")

    def _end_waiting(self, reason: str) -> None:
        """No more commands; those queued fail, and every stream ends with `reason`."""
        with self._stopping:
            self._stopped = True
        while not self._commands.empty():
            self._commands.get()[2].set_exception(RuntimeError("the engine loop has stopped"))
        for request_id, outputs in list(self.outputs.items()):
            outputs.put(RequestOutput(request_id, [], "", finished=True, finish_reason=reason))
        self.outputs.clear()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self.outputs.get(out.request_id)
            if q is not None:
                q.put(out)
                if out.finished:
                    del self.outputs[out.request_id]

    def _run(self) -> None:
        try:
            with torch.inference_mode():  # for good: each step would enter it again otherwise (engine/inference.py)
                self._serve()
        finally:
            if not self._stopped:  # died: commands queued later would wait forever, and every stream
                log.error("the engine loop's thread died: its requests end with an error")
                self._end_waiting("error")

    def _serve(self) -> None:
        while not self._stopped:
            self.progressed = time.monotonic()
            while not self._commands.empty():
                fn, args, future = self._commands.get()
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # the caller gets it (and the loop ends, for what is not an Exception)
                    future.set_exception(e)
                    if not isinstance(e, Exception):
                        raise
            if self.engine.has_unfinished():
                self._step()
            # Idle, or stalled until a command frees blocks (a release, an abort, an admission):
            # stepping on would spin a core the threads serving those commands need.
            if not self.engine.has_unfinished() or self.engine.stalled:
                self._wake.wait(0.1)
                self._wake.clear()

    def _step(self) -> None:
        try:
            self._dispatch(self.engine.step())
            self._failed_steps = 0
        except Exception:  # a bug in a step must not leave every client waiting forever
            self._failed_steps, self._failed_at = self._failed_steps + 1, time.monotonic()
            log.exception("engine step failed; ending its requests with an error")
            for request_id in list(self.engine.seqs):
                try:
                    self.engine.abort(request_id, reason="error")  # counted as finished_error
                except Exception:  # the loop must outlive it: every other request still waits on it
                    log.exception("ending %s after the failed step failed too", request_id)
            # Every stream ends "error" (not "abort", which a client asked for), the requests the
            # failed step finished or handed off too: their outputs were lost with it, and with a
            # hand-off's its handle: nobody will read or release its pinned blocks but here.
            for request_id in [r for r in self.outputs if r in self.engine.handed_off]:
                self.engine.release(request_id)
            self._dispatch([RequestOutput(r, [], "", finished=True, finish_reason="error") for r in list(self.outputs)])
        with self.stepped:
            self.stepped.notify_all()


def _drain(items: collections.deque) -> list:
    """What another thread appended so far, removed (whatever it appends meanwhile stays)."""
    drained = []
    while items:
        drained.append(items.popleft())
    return drained
