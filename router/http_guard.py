"""What the HTTP API refuses before it reads a request's body: a call to /v1/ without a current API
key (401) or with more than one Authorization header (400), and a body it was not told the size of
(411) or that is too large (413).

FastAPI reads and parses a body before an endpoint runs, so a check inside the endpoint came after
any client, keyed or not, had made the router hold and parse as much JSON as it cared to send (a
100 MB token list is ~50 M Python objects: the router's pod ran out of memory). This ASGI layer
answers from the request's headers alone. uvicorn (h11) refuses a body longer than its
Content-Length, so the length checked is the length read.
"""

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import JSONResponse

from router.openai_schema import OpenAIError

# The largest request body taken (a chat or completion request's JSON): a 128K-token prompt as
# text or as token ids is ~1 MB. The public gRPC port takes messages up to the same size.
MAX_REQUEST_BYTES = 8 * 1024 * 1024

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class RequestGuard:
    """ASGI middleware over the API: `authorized(header)` says whether an Authorization header holds
    a current key; `refused(status)` counts each refusal."""

    def __init__(self, app: Callable, authorized: Callable[[str], bool], refused: Callable[[str], None]) -> None:
        self.app, self.authorized, self.refused = app, authorized, refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            refusal = self._refusal(scope)
            if refusal is not None:
                self.refused(str(refusal.status))
                await JSONResponse(refusal.body(), status_code=refusal.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> OpenAIError | None:
        headers = {name.lower(): value for name, value in scope["headers"]}
        if sum(name.lower() == b"authorization" for name, _ in scope["headers"]) > 1:  # this check and the
            # endpoint's owner of the request would read different ones
            return OpenAIError(400, "send one Authorization header", "invalid_request_error")
        if not self.authorized(headers.get(b"authorization", b"").decode("latin-1")):
            return OpenAIError(401, "missing or unknown API key: send the header 'Authorization: Bearer <key>' "
                               "with a key of router.api_key_file", "authentication_error")
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return None
        length = headers.get(b"content-length")
        if length is None:
            return OpenAIError(411, "send the body's size in a Content-Length header (a chunked body is not "
                               "taken)", "invalid_request_error")
        if not length.isdigit() or int(length) > MAX_REQUEST_BYTES:
            return OpenAIError(413, f"the body is {length.decode('latin-1')} bytes; at most {MAX_REQUEST_BYTES} "
                               "are taken", "invalid_request_error")
        return None
