"""A minimal client of the public Router API: stream one chat answer to a terminal."""

import sys
from collections.abc import Iterator

from proto import rpc
from proto.pdspec.v1 import common_pb2, router_pb2, router_pb2_grpc
from proto.tls import Tls


def chat(router_address: str, prompt: str, max_tokens: int = 256, temperature: float = 0.0,
         system: str | None = None, timeout_s: float = 300.0, tls: Tls | None = None,
         api_key: str | None = None) -> Iterator[router_pb2.GenerateResponse]:
    """`api_key`: a key of the router's api_key_file, sent as a bearer token (a router without one ignores it)."""
    messages = ([common_pb2.ChatMessage(role="system", content=system)] if system else [])
    messages.append(common_pb2.ChatMessage(role="user", content=prompt))
    request = router_pb2.GenerateRequest(messages=router_pb2.MessageList(messages=messages),
                                         sampling=common_pb2.SamplingOptions(max_tokens=max_tokens, temperature=temperature))
    with rpc.channel(router_address, tls=tls) as channel:
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        yield from router_pb2_grpc.RouterStub(channel).Generate(request, timeout=timeout_s, metadata=metadata)


def print_chat(router_address: str, prompt: str, **kwargs) -> router_pb2.GenerateResponse:
    """Stream the answer to stdout; returns the last response (finish reason, usage, acceptance)."""
    last = None
    for last in chat(router_address, prompt, **kwargs):
        sys.stdout.write(last.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return last
