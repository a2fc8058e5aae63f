"""The router's OpenAI-compatible HTTP API (FastAPI): chat and text completions, streamed as
server-sent events or whole, the served model, liveness, readiness and Prometheus metrics.

Each completion is one call to the router's own Generate, in this process (router/local_call.py),
so one path validates, routes, retries and counts requests whichever front a client uses. A
client that disconnects cancels that call, and the router frees the request on every worker, as
it does for a gRPC client that leaves.
"""

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from proto import rpc
from proto.pdspec.v1 import router_pb2
from router.api_keys import AUTHORIZATION_METADATA_KEY
from router.http_guard import RequestGuard
from router.local_call import LocalCall
from router.openai_schema import (ChatCompletionRequest, CompletionRequest, OpenAIError, Shape, api_field, extension,
                                  invalid, usage)
from router.validation import CONTEXT_LIMIT, shown

# The names pydantic puts in an error's location for the type of a union it tried (str, list[int], ...).
_UNION_BRANCH = re.compile(r"str|int|float|bool|none|constrained-\w+|(list|dict|tuple|literal|function-\w+)\[.*\]")
# gRPC status -> (HTTP status, OpenAI error type).
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


def create_app(generate: Callable, model_name: str, registry: CollectorRegistry, ready: Callable[[], bool],
               authorized: Callable[[str], bool], refused: Callable[[str], None] = lambda status: None) -> FastAPI:
    """`generate`: the router's RouterServicer.Generate; `ready`: whether a request sent now has a
    route (the readiness the gRPC health service reports); `authorized`: whether an Authorization
    header holds an API key (checked here, by RequestGuard: the in-process call passes no
    interceptor; the header goes along as the call's metadata, for Abort's owner); `refused(status)`:
    counts a request RequestGuard refused."""
    app = FastAPI(title="pdspec", summary="OpenAI-compatible API of a pdspec cluster")
    app.add_middleware(RequestGuard, authorized=authorized, refused=refused)  # keys and sizes, before a body is read

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, e: RequestValidationError) -> JSONResponse:
        # A field of several types (content: a string or parts) fails once per type: the failure
        # deepest in, then furthest along a list, is in the type the client meant (an image part,
        # not "should be a string"; ["a", 5]'s 5, not its "a").
        error = max(e.errors(), key=lambda err: (len(err["loc"]), [p for p in err["loc"] if isinstance(p, int)]))
        path = [str(p) for p in error["loc"] if p != "body" and not _UNION_BRANCH.fullmatch(str(p))]
        if error["type"] == "json_invalid":  # its location is a character offset, not a field
            return await openai_error(request, invalid("body", f"not valid JSON: {error['msg']} (at character "
                                                               f"{'.'.join(path)})"))
        if error["loc"] == ("body",) and "json" not in request.headers.get("content-type", "").lower():
            return await openai_error(request, invalid("body", "send it as JSON with Content-Type: application/json "
                                                               f"(got {request.headers.get('content-type')!r})"))
        got = f", got {shown(repr(error['input']))}" if isinstance(error.get("input"), (str, int, float, bool)) else ""
        return await openai_error(request, invalid(path[0] if path else "body",
                                                   f"{error['msg']}{got} (at {'.'.join(path)})"))

    @app.exception_handler(HTTPException)
    async def no_route(request: Request, e: HTTPException) -> JSONResponse:
        """404 (no such path) and 405 (not with that method) in OpenAI's shape too."""
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return await openai_error(request, OpenAIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                                       kind, headers=e.headers))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def readiness() -> JSONResponse:
        if ready():
            return JSONResponse({"status": "ready"})
        raise OpenAIError(503, "no route yet: needs a prefill and a decode worker, or an aggregated one",
                          "service_unavailable")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    served = {"id": model_name, "object": "model", "created": 0, "owned_by": "pdspec"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [served]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return served

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _complete(body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _complete(body, request, chat=False)

    def check_model(requested: str | None) -> None:
        if requested is not None and requested != model_name:
            raise OpenAIError(404, f"model: {requested!r} is not served here; this cluster serves {model_name!r} "
                              "(GET /v1/models)", "not_found_error", "model")

    async def _complete(body: ChatCompletionRequest | CompletionRequest, request: Request, chat: bool) -> Response:
        header = request.headers.get("authorization", "")  # a current key's (RequestGuard checked it)
        check_model(body.model)
        request_id = uuid.uuid4().hex
        shape = Shape(chat, request_id, model_name)
        metadata = ((AUTHORIZATION_METADATA_KEY, header),) if header else ()
        # Off the event loop: a prompt of a million token ids takes ~0.5 s to check and encode, a
        # pause in every other client's stream.
        message = await asyncio.to_thread(body.generate_request, request_id)
        call = LocalCall(generate, message, metadata, body.timeout)
        async with _cancel_on_disconnect(request, call) as left:
            try:
                if not body.stream:
                    return JSONResponse(await _whole(call, shape))
                first = await _next(call)  # a request refused before its first token gets its own HTTP status
            except (asyncio.CancelledError, OpenAIError):  # the call ended "the client left" when it did
                if not left():  # a failure, or the server cut it (a drain's grace ran out): its workers stop too
                    call.cancel()
                    raise
                return Response(status_code=499)  # nobody reads it: logged as the client's, not a server error
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        # The call is cancelled however the response ends (a no-op once it finished), also when the
        # client leaves before the stream's generator has started (its own `finally` never runs then).
        async def cancel() -> None:  # on the event loop: LocalCall's queue is not thread-safe
            call.cancel()

        return StreamingResponse(_events(call, first, shape, include_usage), media_type="text/event-stream",
                                 background=BackgroundTask(cancel))

    return app


async def _next(call) -> router_pb2.GenerateResponse:
    try:
        message = await call.read()
    except grpc.RpcError as e:
        status, kind = _HTTP_STATUS.get(e.code(), (500, "internal_error"))
        text, param = api_field(e.details() or e.code().name) if status == 400 else (e.details(), None)
        retry_after = dict(e.trailing_metadata() or ()).get(rpc.RETRY_AFTER_METADATA_KEY)
        code = "context_length_exceeded" if status == 400 and CONTEXT_LIMIT in text else None  # OpenAI's code
        raise OpenAIError(status, text, kind, param, {"Retry-After": retry_after} if retry_after else None,
                          code) from None
    if message is grpc.aio.EOF:
        raise OpenAIError(502, "the router's stream ended without a finish_reason", "internal_error")
    return message


async def _whole(call, shape: Shape) -> dict[str, Any]:
    message = await _next(call)
    texts = [message.text]
    while not message.finish_reason:
        message = await _next(call)
        texts.append(message.text)
    return shape.whole("".join(texts), message)


async def _events(call, message: router_pb2.GenerateResponse, shape: Shape, include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks as OpenAI streams them; a failure after the status line is an error event.
    The events ready together go out in one write (each write is a send and a trip through the
    server's middleware): the role with the first text, the last text with the usage and [DONE]."""
    fields = {"usage": None} if include_usage else {}
    # a chat stream opens with the assistant's role
    ready = [_event(shape.chunk([shape.choice("", None, delta=True, first=True)], **fields))] if shape.chat else []
    try:
        while True:
            last = bool(message.finish_reason)
            if message.text or last:
                choice = shape.choice(message.text, message.finish_reason, delta=True)
                ready.append(_event(shape.chunk([choice], **fields, **(extension(message) if last else {}))))
            if last:
                break
            if ready:
                yield "".join(ready)
                ready = []
            message = await _next(call)
        if include_usage:
            ready.append(_event(shape.chunk([], usage=usage(message))))
    except OpenAIError as e:
        ready.append(_event(e.body()))
    finally:
        call.cancel()  # finished: a no-op; cancelled (the client left): the router stops the request
    yield "".join(ready) + "data: [DONE]\n\n"


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


@contextlib.asynccontextmanager
async def _cancel_on_disconnect(request: Request, call) -> AsyncIterator[Callable[[], bool]]:
    """Cancel `call` if the client disconnects before the answer is sent; yields "did it?"."""
    left = False

    async def watch() -> None:
        nonlocal left
        while (await request.receive())["type"] != "http.disconnect":
            pass
        left = True
        call.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield lambda: left
    finally:
        watcher.cancel()
