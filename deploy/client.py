"""A minimal client of the public Router API: stream one chat answer to a terminal."""

import sys
from collections.abc import Iterator

import grpc

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


def answer(router_address: str, prompt: str, tls: Tls | None, api_key: str | None) -> None:
    """Stream the answer to stdout, then its finish reason, usage and acceptance (`pdspec chat`,
    `serve --once`). The router's refusal, or a stream with no answer, is a RuntimeError the CLI
    says as an error."""
    last = None
    try:
        for last in chat(router_address, prompt, tls=tls, api_key=api_key):
            sys.stdout.write(last.text)
            sys.stdout.flush()
    except grpc.RpcError as e:
        raise RuntimeError(f"the router at {router_address} answered {e.code().name}: {e.details()}") from None
    sys.stdout.write("\n")
    if last is None:
        raise RuntimeError(f"the router at {router_address} ended the stream without an answer")
    print(f"pdspec: finish_reason={last.finish_reason} prompt_tokens={last.usage.prompt_tokens} "
          f"completion_tokens={last.usage.completion_tokens} "
          f"mean_acceptance_length={last.acceptance.mean_acceptance_length:.2f}", flush=True)
