"""The router's public gRPC servicer: Generate, Abort, ListWorkers (the internal Registry that
workers register and heartbeat with is router/registry.py's).

Generate waits for a running slot in the admission queue (router/admission.py), then, per attempt:
choose workers -> Prefill (disaggregated only) -> Decode(prefilled=handle)
-> relay the decode stream. An attempt that fails before the decode stream's first response
releases the prefill worker's pin and is retried on other workers (the failed one is skipped for
this request; one that refused as full is only avoided), up to router.max_retries times. Once output has reached the client nothing is
retried: the stream ends with UNAVAILABLE (DEADLINE_EXCEEDED for a deadline, RESOURCE_EXHAUSTED
for full workers) naming the worker.
"""

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict
from typing import NoReturn

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.admission import Admission, LeftQueue, Overloaded, QueueDeadline
from router.attempt import Plan, WorkerFailed, client_code, culprit
from router.api_keys import AUTHORIZATION_METADATA_KEY, ApiKeys
from router.calls import CallSlots, Peers, Run, run_key
from router.config import RouterConfig
from router.metrics import RouterMetrics
from engine.tokenizer import Tokenizer
from proto import rpc
from proto.pdspec.v1 import common_pb2, kv_pb2, kv_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from proto.tls import Tls
from router.policy import PrefillPolicy, least_loaded, make_policy
from router.registry import Registry, WorkerView
from router.validation import InvalidRequest, ValidRequest, validate
from router.watchdog import Watchdog
from serving.roles import WORKER_ROLES

log = logging.getLogger(__name__)
_BEST_EFFORT_TIMEOUT_S = 5.0
_PROBE_TIMEOUT_S = 1.0
_FULL_WORKER_PAUSE_S = 0.25  # times the retry's number, before a retry on a worker that refused as full
# A call still open this long past its request's deadline is stuck in a send to a client that
# stopped reading (router/watchdog.py); the deadline's own ending, relayed, comes well before.
_STUCK_AFTER_S = 10.0


class _Cancelled(Exception):
    """The client went away or called Abort."""


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, registry: Registry, tokenizer: Tokenizer, config: RouterConfig, token: str | None,
                 metrics: RouterMetrics, admission: Admission, api_keys: ApiKeys | None = None,
                 policy: PrefillPolicy | None = None, tls: Tls | None = None) -> None:
        self._registry, self._tokenizer, self._config, self._admission = registry, tokenizer, config, admission
        self._api_keys = api_keys
        self._policy = policy or make_policy(config)
        self._peers = Peers(token, tls)
        self._prefill_slots = CallSlots()
        self._metrics = metrics
        self._runs_lock = threading.Lock()
        self._runs: dict[str, Run] = {}
        self._watchdog = Watchdog(_STUCK_AFTER_S)

    def close(self) -> None:
        """Once no call runs: the watchdog's thread and the channels to workers go."""
        self._watchdog.stop()
        self._peers.keep_only(set())

    def Generate(self, request, context) -> Iterator[router_pb2.GenerateResponse]:
        observer = self._metrics.start()
        answered = False  # its last message sent: how the call closes after that changes nothing
        try:
            for response in self._generate(request, context):
                observer.on_response(response)
                yield response  # gRPC comes back for the next one only once this one was sent
                answered = response.finish_reason not in ("", "abort")
        finally:
            observer.finish("OK" if answered else _status_name(context))

    def _generate(self, request, context) -> Iterator[router_pb2.GenerateResponse]:
        try:
            req = validate(request, self._tokenizer, self._registry.max_model_len())
        except InvalidRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        run = Run(run_key(self._owner(context), req.request_id))
        with self._runs_lock:
            if run.key in self._runs:
                context.abort(grpc.StatusCode.ALREADY_EXISTS,  # as the workers say it: the request is well formed
                              f"request_id: {req.request_id!r} is already running; send a unique id or none")
            self._runs[run.key] = run
        if not context.add_callback(run.cancel):  # fires when the RPC ends: if the client left, stop the worker
            run.cancel()  # it ended already (the client left while the prompt was tokenized)
        try:
            yield from self._admitted(req, run, context)
        finally:
            with self._runs_lock:
                run.finish()
                del self._runs[run.key]

    def _admitted(self, req: ValidRequest, run: Run, context) -> Iterator[router_pb2.GenerateResponse]:
        """Serve the request in a running slot, or refuse it: RESOURCE_EXHAUSTED (with the seconds to
        wait before a retry as retry-after metadata), DEADLINE_EXCEEDED, or an abort while it waited."""
        try:
            slot = self._admission.enter(lambda: run.cancelled or not context.is_active(), context.time_remaining())
        except Overloaded as e:
            context.set_trailing_metadata(((rpc.RETRY_AFTER_METADATA_KEY, str(e.retry_after_s)),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except QueueDeadline as e:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        except LeftQueue:
            yield _aborted(req, completion_tokens=0)
            return
        run.queued_s = slot.waited_s
        # One deadline for the request however many attempts it takes: router.request_timeout_s
        # from now, or the client's if sooner.
        run.deadline = time.monotonic() + min(self._config.request_timeout_s, context.time_remaining())
        stop_watching = self._watchdog.watch(run.deadline, context.cancel)
        try:
            yield from self._serve(req, run, context)
        finally:
            stop_watching()
            slot.release()

    def Abort(self, request, context) -> common_pb2.AbortResponse:
        """Ends a running request made with the caller's API key; another key's is not found."""
        with self._runs_lock:
            run = self._runs.get(run_key(self._owner(context), request.request_id))
        if run is not None:
            run.cancel()
            return common_pb2.AbortResponse(found=True)
        return common_pb2.AbortResponse(found=False)

    def _owner(self, context) -> str:
        if self._api_keys is None:
            return ""
        metadata = dict(context.invocation_metadata())
        return self._api_keys.owner(metadata.get(AUTHORIZATION_METADATA_KEY, "")) or ""

    def ListWorkers(self, request, context) -> router_pb2.ListWorkersResponse:
        return router_pb2.ListWorkersResponse(
            workers=[router_pb2.WorkerStatus(**asdict(w)) for w in self._registry.workers()])

    def _serve(self, req: ValidRequest, run: Run, context) -> Iterator[router_pb2.GenerateResponse]:
        # Workers a retry skips (a failed call's), and workers it prefers to skip: a KV hand-off's two
        # sides, since the decode worker that blames its source may share the fault (its own NIXL/UCX
        # path broken, a pull timed out while it was overloaded) and would otherwise, idle and so the
        # least loaded, take every retry. A worker that refused as full is healthy too: avoided, and
        # tried again after a pause when no other worker has its role (a cancelled call may have
        # held its place for a moment).
        suspects: set[str] = set()
        avoid: set[str] = set()
        full: set[str] = set()
        failure: WorkerFailed | None = None
        for attempts in range(1, self._config.max_retries + 2):
            plan = self._plan(req, suspects, avoid)
            if plan is not None and full & plan.worker_ids():
                run.pause(_FULL_WORKER_PAUSE_S * (attempts - 1))
                if run.cancelled:
                    yield _aborted(req, completion_tokens=0)
                    return
                plan = self._plan(req, suspects, avoid)  # workers may have come or gone meanwhile
            if plan is None:
                attempts -= 1
                break
            self._registry.note_routed(plan.worker_ids(), run.key, plan.blocks)
            try:
                first, rest = self._attempt(req, plan, run, context,
                                            retry_follows=attempts <= self._config.max_retries)
            except _Cancelled:
                yield _aborted(req, completion_tokens=0)
                return
            except WorkerFailed as e:
                if e.request_refused:
                    log.info("request %s refused: %s", req.request_id, e.logged)
                    context.abort(e.code, str(e))
                if e.code == grpc.StatusCode.DEADLINE_EXCEEDED and run.time_left() <= 0:  # no time left to retry in
                    log.warning("request %s: %s; no time left to retry", req.request_id, e.logged)
                    context.abort(e.code, f"{e}{self._deadline_note(context)}")
                log.warning("request %s: %s; retrying", req.request_id, e.logged)
                if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:  # a full worker is a healthy one
                    self._probe(e.worker)
                if e.reported_by is not None:
                    avoid |= {e.worker.worker_id, e.reported_by.worker_id}
                elif e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    full.add(e.worker.worker_id)
                    avoid.add(e.worker.worker_id)
                else:
                    suspects.add(e.worker.worker_id)
                failure = e
                continue
            try:
                yield from self._relay(req, plan, first, rest, run, context)
            finally:
                self._registry.forget_routed(plan.worker_ids(), run.key)
            return
        self._give_up(req, failure, attempts, context)

    def _plan(self, req: ValidRequest, suspects: set[str], avoid: set[str]) -> Plan | None:
        """Disaggregated if a prefill and a decode worker are available, else aggregated, else None;
        of each role, workers outside `avoid` where there are any."""
        workers = [w for w in self._registry.workers() if w.worker_id not in suspects]
        by_role = {role: [w for w in workers if w.role == role] for role in WORKER_ROLES}
        by_role = {role: [w for w in ws if w.worker_id not in avoid] or ws for role, ws in by_role.items()}
        overlaps, blocks = self._registry.prefix_overlaps(req.prompt_token_ids)
        if by_role["prefill"] and by_role["decode"]:
            return Plan(self._policy.choose(by_role["prefill"], overlaps, blocks), least_loaded(by_role["decode"]), blocks)
        if by_role["aggregated"]:
            return Plan(None, least_loaded(by_role["aggregated"]), blocks)
        return None

    def _attempt(self, req: ValidRequest, plan: Plan, run: Run, context, retry_follows: bool) -> tuple[
            worker_pb2.DecodeResponse, Iterator[worker_pb2.DecodeResponse]]:
        """Prefill (if disaggregated), then open the decode stream up to its first response.
        `retry_follows`: retries are left if this attempt fails."""
        handle, arrived, reporter = None, False, None
        try:
            handle = self._prefill(req, plan.prefill, run, context) if plan.prefill is not None else None
            opened = self._open_decode(req, plan, handle, run, context)
            arrived = True
            return opened
        except (WorkerFailed, _Cancelled) as e:
            # UNAVAILABLE from a decode worker blaming its source: a pull that failed, after the worker
            # took the request over (its other blames, a handle or layout refused, come before).
            reporter = e.reported_by if isinstance(e, WorkerFailed) and e.code == grpc.StatusCode.UNAVAILABLE else None
            if plan.prefill is not None:  # nobody will fetch the prompt's blocks: unpin them now
                # If the prefill worker may serve the retry, let the Release land first: arriving
                # late, it would unpin the retry's prefill of the same request id. (No retry follows a
                # request refused, one out of time or the last attempt: its client's error waited on
                # the Release.)
                retry_may_reuse = (retry_follows and isinstance(e, WorkerFailed)
                                   and e.worker.worker_id != plan.prefill.worker_id
                                   and not e.request_refused and run.time_left() > 0)
                self._release(plan.prefill, run.key, handle.pin_id if handle else "", wait=retry_may_reuse)
            raise
        finally:
            if not arrived:  # on success, the heartbeats naming it take over counting it
                # A prefill that answered ran there, and a decode worker whose pull failed had taken
                # the request over: their next heartbeats name it, late.
                reached = ([plan.prefill.worker_id] if handle is not None else []) + (
                    [reporter.worker_id] if reporter is not None else [])
                self._registry.forget_routed(plan.worker_ids(), run.key, reached)

    def _release(self, worker: WorkerView, request_id: str, pin_id: str, wait: bool) -> None:
        """`pin_id`: the handle's (empty: the prefill's answer was lost, so whichever pin it made)."""
        stub = kv_pb2_grpc.KVTransferStub(self._peers.channel(worker.address))
        call = stub.Release.future(kv_pb2.ReleaseRequest(request_id=request_id, pin_id=pin_id),
                                   timeout=_BEST_EFFORT_TIMEOUT_S)
        _fire_and_forget(call, f"Release of {request_id} on {worker.worker_id}")
        if wait:
            call.exception()  # blocks until done; a failure is logged, and the retry goes ahead anyway

    def _prefill(self, req: ValidRequest, worker: WorkerView, run: Run, context) -> kv_pb2.KVHandle:
        stub = worker_pb2_grpc.PrefillWorkerStub(self._peers.channel(worker.address))
        request = worker_pb2.PrefillRequest(request_id=run.key, prompt_token_ids=req.prompt_token_ids,
                                            sampling=req.sampling)
        with self._prefill_slots.held(worker.worker_id, self._registry.call_limit(worker.worker_id), run):
            call = stub.Prefill.future(request, timeout=run.time_left())
            run.track(call)
            try:
                return call.result()
            except grpc.FutureCancelledError:
                raise _Cancelled() from None
            except grpc.RpcError as e:
                raise (_Cancelled() if run.cancelled else WorkerFailed(worker, "Prefill", e)) from None

    def _open_decode(self, req: ValidRequest, plan: Plan, handle: kv_pb2.KVHandle | None, run: Run,
                     context) -> tuple[worker_pb2.DecodeResponse, Iterator[worker_pb2.DecodeResponse]]:
        worker = plan.decode
        stub = worker_pb2_grpc.DecodeWorkerStub(self._peers.channel(worker.address))
        request = worker_pb2.DecodeRequest(request_id=run.key, prompt_token_ids=req.prompt_token_ids,
                                           sampling=req.sampling, speculation=req.speculation, prefilled=handle)
        call = stub.Decode(request, timeout=run.time_left())
        abort = common_pb2.AbortRequest(request_id=run.key)
        # Cancelling the stream frees the request on the worker; the Abort RPC covers a worker that
        # has not noticed the cancellation (e.g. still waiting to admit it).
        run.track(call, lambda: _fire_and_forget(stub.Abort.future(abort, timeout=_BEST_EFFORT_TIMEOUT_S),
                                                 f"Abort on {worker.worker_id}"))
        try:
            return next(call), call
        except StopIteration:
            raise WorkerFailed(worker, "Decode", "the stream ended before its first response") from None
        except grpc.RpcError as e:
            if run.cancelled:
                raise _Cancelled() from None
            failed = culprit(e, plan)
            step = "Decode" if failed is worker else f"KV hand-off to decode worker {worker.worker_id}"
            raise WorkerFailed(failed, step, e, reported_by=worker if failed is not worker else None) from None

    def _relay(self, req: ValidRequest, plan: Plan, first: worker_pb2.DecodeResponse,
               rest: Iterator[worker_pb2.DecodeResponse], run: Run, context) -> Iterator[router_pb2.GenerateResponse]:
        response = _response(first, run.queued_s)
        response.request_id = req.request_id  # the first message names the request and its route
        response.prefill_worker = (plan.prefill or plan.decode).worker_id
        response.decode_worker = plan.decode.worker_id
        if first.finish_reason:
            run.finish()
        yield response
        emitted = len(first.token_ids)
        try:
            for out in rest:
                if out.finish_reason:
                    run.finish()
                yield _response(out, run.queued_s)
                emitted += len(out.token_ids)
        except grpc.RpcError as e:
            if run.finished:  # the stream failed after its last message: the answer is whole
                return
            if not run.cancelled:
                failure = WorkerFailed(plan.decode, "Decode", e)
                log.warning("request %s: %s after %d streamed tokens", req.request_id, failure.logged, emitted)
                self._probe(plan.decode)
                context.abort(client_code(failure.code), f"{failure} after {emitted} tokens were streamed; not retried, "
                              f"the output was already sent{self._deadline_note(context, failure.code)}")
            yield _aborted(req, emitted, first=False)

    def _give_up(self, req: ValidRequest, failure: WorkerFailed | None, attempts: int, context) -> NoReturn:
        if failure is None:
            roles = Counter(w.role for w in self._registry.workers())
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          "no prefill/decode workers registered: need a prefill and a decode worker, or an "
                          f"aggregated one (registered: {dict(roles) or 'none'})")
        log.warning("request %s: gave up after %d failed attempt(s); the last: %s", req.request_id, attempts,
                    failure.logged)
        if failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # full workers: when to retry, as admission says
            retry_after_s = math.ceil(_FULL_WORKER_PAUSE_S * (attempts + 1))  # the router's own next pause
            context.set_trailing_metadata(((rpc.RETRY_AFTER_METADATA_KEY, str(retry_after_s)),))
        context.abort(client_code(failure.code),
                      f"request {req.request_id}: {failure}; gave up after {attempts} failed attempt(s) "
                      f"(router.max_retries={self._config.max_retries}){self._deadline_note(context, failure.code)}")

    def _deadline_note(self, context, code: grpc.StatusCode = grpc.StatusCode.DEADLINE_EXCEEDED) -> str:
        """Which deadline ended a request: the client's, or the router's own setting (named)."""
        if code != grpc.StatusCode.DEADLINE_EXCEEDED:
            return ""
        if context.time_remaining() <= 0:
            return ": the client's deadline passed"
        return (f"; router.request_timeout_s ({self._config.request_timeout_s:g} s) bounds a whole request, its "
                "retries and stream included: raise it for long generations")

    def unreachable(self, address: str) -> str:
        """Why this router's calls to a worker at `address` cannot get there, or ""."""
        return self._peers.unreachable(address)

    def forget_unregistered(self) -> None:
        """Workers come and go at new addresses and ids (a pod's IP and name are its own): keep channels
        to the registered only, and their metrics' series."""
        workers = self._registry.workers()
        self._peers.keep_only({w.address for w in workers})
        self._metrics.keep_workers(w.worker_id for w in workers)

    def _probe(self, worker: WorkerView) -> None:
        """A call to `worker` failed: check its health now, and if that fails too (or answers
        NOT_SERVING: its engine is in trouble), stop routing to it at once (rather than when its
        heartbeats are missed); it registers again if it lives."""
        stub = health_pb2_grpc.HealthStub(self._peers.channel(worker.address))
        check = stub.Check.future(health_pb2.HealthCheckRequest(), timeout=_PROBE_TIMEOUT_S)

        def done(call: grpc.Future) -> None:
            ok = call.code() == grpc.StatusCode.OK
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(call.result().status) if ok else call.code().name
            if status != "SERVING" and self._registry.evict(worker.worker_id, worker.address, worker.registration_id):
                log.warning("dropped %s worker %s (%s) from routing: a call failed and so did its health check "
                            "(%s)", worker.role, worker.worker_id, worker.address, status)

        check.add_done_callback(done)


def _response(out: worker_pb2.DecodeResponse, queued_s: float) -> router_pb2.GenerateResponse:
    response = router_pb2.GenerateResponse(text=out.text, token_ids=out.token_ids, finish_reason=out.finish_reason)
    if out.HasField("usage"):
        response.usage.CopyFrom(out.usage)
        response.usage.queue_seconds += queued_s  # the router's queue, then the workers'
    if out.HasField("acceptance"):
        response.acceptance.CopyFrom(out.acceptance)
    return response


def _aborted(req: ValidRequest, completion_tokens: int, first: bool = True) -> router_pb2.GenerateResponse:
    """The last message of an aborted request (`first`: nothing was sent before it)."""
    usage = common_pb2.Usage(prompt_tokens=len(req.prompt_token_ids), completion_tokens=completion_tokens)
    return router_pb2.GenerateResponse(request_id=req.request_id if first else "", finish_reason="abort", usage=usage)


def _status_name(context) -> str:
    """How a Generate ended: the code it aborted with, CANCELLED if the client left, else OK."""
    code = context.code()
    if code is not None:
        return code.name
    return "OK" if context.is_active() else "CANCELLED"


def _fire_and_forget(call: grpc.Future, what: str) -> None:
    # The callback also keeps the call referenced: grpc cancels a call whose future is collected.
    call.add_done_callback(lambda c: c.code() == grpc.StatusCode.OK or log.info("%s failed: %s", what, c.details()))
