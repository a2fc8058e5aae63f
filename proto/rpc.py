"""gRPC plumbing shared by every pdspec server and client: health checking and reflection on
every server, a shared-token check on internal services, deadlines, message size limits.

Internal services (registry, prefill, decode, KV transfer) require the cluster token in the
`x-pdspec-token` metadata when one is configured: NIXL agent metadata (a pickle) is only ever
handed to, and accepted from, peers that know it (NIXL requires a token). The token is a bearer
secret: without TLS, whoever answers at a peer's address receives it. The public Router service is open unless
the router sets API keys (a further `gates` entry, router/api_keys.py).

With TLS (`Tls`, from the config's `tls` section) every server listens with the process's
certificate, and internal servers also require the caller's, signed by the cluster's CA (mutual
TLS): the token stays as a second factor.
"""

import collections
import hmac
import socket
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto.tls import Tls, current

TOKEN_METADATA_KEY = "x-pdspec-token"
# Trailing metadata on a failed Decode whose KV source (the prefill worker) failed: its worker id,
# so the router retries on another prefill worker instead of blaming the decode worker.
FAILED_KV_SOURCE_METADATA_KEY = "x-pdspec-failed-kv-source"
# Trailing metadata on a Generate refused with RESOURCE_EXHAUSTED: whole seconds to wait before a
# retry (the HTTP front's Retry-After).
RETRY_AFTER_METADATA_KEY = "retry-after"
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class MetadataGate(grpc.ServerInterceptor):
    """Refuses calls to `names` (services, "pdspec.v1.Registry", or methods,
    "pdspec.v1.Router/ListWorkers") with UNAUTHENTICATED when `refusal(metadata)` returns a
    message; health, reflection and everything else pass."""

    def __init__(self, names: set[str], refusal: Callable[[dict[str, str]], str | None]):
        self._names, self._refusal = names, refusal

    def intercept_service(self, continuation, details):
        method = details.method.lstrip("/")
        if method not in self._names and method.split("/")[0] not in self._names:
            return continuation(details)
        message = self._refusal(dict(details.invocation_metadata))
        if message is None:
            return continuation(details)

        def deny(requests, context):  # never reads them (a unary handler took in the whole message first:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)  # 256 MB an unauthenticated call)

        handler = continuation(details)
        streaming = handler is not None and handler.response_streaming
        return (grpc.stream_stream_rpc_method_handler if streaming else grpc.stream_unary_rpc_method_handler)(deny)


def _token_gate(token: str, internal: set[str]) -> MetadataGate:
    expected = token.encode()

    def refusal(metadata: dict[str, str]) -> str | None:
        if hmac.compare_digest(metadata.get(TOKEN_METADATA_KEY, "").encode(), expected):
            return None
        return "missing or wrong x-pdspec-token for an internal service"

    return MetadataGate(internal, refusal)


class _Unparsable:
    def __init__(self, reason: str):
        self.reason = reason


class _MalformedRequest(grpc.ServerInterceptor):
    """A request that does not parse (e.g. a string field holding invalid UTF-8) is the caller's
    error: INVALID_ARGUMENT naming the method, where grpc itself would answer INTERNAL."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse, kind = handler.request_deserializer, "unary_stream" if handler.response_streaming else "unary_unary"
        behavior = getattr(handler, kind)

        def deserialize(data: bytes):
            try:
                return parse(data)
            except Exception as e:  # protobuf's DecodeError, whatever the runtime names it
                return _Unparsable(str(e))

        def run(request, context):
            if isinstance(request, _Unparsable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{details.method}: the request is not a valid message "
                              f"({request.reason}); string fields must be UTF-8")
            return behavior(request, context)

        return handler._replace(request_deserializer=deserialize, **{kind: run})


Registration = tuple[Callable[[object, grpc.Server], None], object, str]  # (add_*_to_server, servicer, full name)


def serve(services: Sequence[Registration], address: str, token: str | None = None,
          internal: Sequence[str] = (), max_workers: int = 64,
          health_servicer: health.HealthServicer | None = None, not_ready: Sequence[str] = (),
          gates: Sequence[MetadataGate] = (), tls: Tls | None = None,
          client_auth: bool = True, max_receive_bytes: int = MAX_MESSAGE_BYTES) -> tuple[grpc.Server, int]:
    """Start a server on `address` ("127.0.0.1:0" picks a free port); returns it and its port.

    `internal` names the services (full names, e.g. "pdspec.v1.DecodeWorker") and methods
    ("pdspec.v1.Router/ListWorkers") that need the token.
    Health: the "" service (liveness) and every service SERVING, except those in `not_ready`,
    which start NOT_SERVING in `health_servicer` (given by a caller that flips them later).
    `gates`: further metadata checks (the router's API keys).
    `tls`: listen with TLS only; `client_auth`: and require a client certificate from the CA
    (internal servers; the public Router's clients have none). `max_receive_bytes`: the largest
    request message taken (a larger one: RESOURCE_EXHAUSTED before any handler sees it)."""
    interceptors = [_MalformedRequest(), *([_token_gate(token, set(internal))] if token else []), *gates]
    # gRPC sets SO_REUSEPORT by default: a second server on a taken port would bind, and the two
    # would split its connections between them at random.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), interceptors=interceptors,
                         options=list((dict(_OPTIONS) | {"grpc.max_receive_message_length": max_receive_bytes,
                                                         "grpc.so_reuseport": 0}).items()))
    health_servicer = health_servicer or health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = []
    for add, servicer, name in services:
        add(servicer, server)
        status = health_pb2.HealthCheckResponse.NOT_SERVING if name in not_ready else health_pb2.HealthCheckResponse.SERVING
        health_servicer.set(name, status)
        names.append(name)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:  # grpc returns 0 or raises, depending on its version
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, tls.server_credentials(client_auth))
    except RuntimeError:
        port = 0
    if port == 0:
        raise RuntimeError(f"could not bind gRPC server to {address}: the port is taken, or the host is not this "
                           "machine's")
    server.start()
    return server, port


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


class _TokenHeader(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self._token = token

    def _with_token(self, d: grpc.ClientCallDetails) -> _CallDetails:
        metadata = list(d.metadata or []) + [(TOKEN_METADATA_KEY, self._token)]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)


def channel(address: str, token: str | None = None, tls: Tls | None = None, own_connection: bool = False
            ) -> grpc.Channel:
    """A client channel to `address`, sending the cluster token on every call when given, over
    TLS (presenting this process's certificate) when `tls` is given. It retries a lost connection
    within 2 s (gRPC's default backoff grows to 120 s: workers came back that late to a restarted
    router, whose calls failed at once meanwhile). The identity is its files' as they are now (a
    renewal since `tls` was read included); the channel presents it for its life. `own_connection`:
    dial anew (channels to one address otherwise share a connection, and its backoff after a failure)."""
    options = _OPTIONS + [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 2000)]
    if own_connection:
        options.append(("grpc.use_local_subchannel_pool", 1))
    tls = current(tls)
    if tls is None:
        ch = grpc.insecure_channel(address, options=options)
    else:
        ch = grpc.secure_channel(address, tls.channel_credentials(), options=options + tls.channel_options())
    return grpc.intercept_channel(ch, _TokenHeader(token)) if token else ch


def wait_healthy(address: str, timeout: float, tls: Tls | None = None) -> None:
    """Block until the server at `address` reports SERVING; raises TimeoutError."""
    with channel(address, tls=tls) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            grpc.channel_ready_future(ch).result(timeout=timeout)
            status = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout).status
        except (grpc.FutureTimeoutError, grpc.RpcError) as e:
            why = f": {e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else ""
            raise TimeoutError(f"gRPC server at {address} not healthy within {timeout:.1f} s{why}") from None
        if status != health_pb2.HealthCheckResponse.SERVING:
            raise TimeoutError(f"gRPC server at {address} reports "
                               f"{health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")


def time_left(context: grpc.ServicerContext) -> float | None:
    """A call's remaining seconds, None without a deadline: gRPC then reports ~2**63 ns, more than
    any timed wait accepts (queue.get raises OverflowError)."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > _NO_DEADLINE_S else remaining


_NO_DEADLINE_S = 1e8  # three years


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now: for a server whose address others must know before it starts."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
