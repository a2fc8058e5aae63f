"""The choice of KV transfer backend for a destination (decode) worker."""

from typing import Literal

import torch

from engine.kv_layout import KVLayout
from kvtransfer.connector import KVConnector
from proto.tls import Tls


def make_connector(backend: Literal["nixl", "grpc"], layout: KVLayout, caches: dict[str, torch.Tensor],
                   token: str | None, tls: Tls | None = None) -> KVConnector:
    # Imported when chosen: NIXL's bundled protobuf/gRPC libraries crash a process that also loads
    # grpc_tools' protoc (see kvtransfer.source._nixl_memory), and a gRPC-only worker need not risk it.
    if backend == "nixl":
        from kvtransfer.nixl_backend import NixlConnector
        return NixlConnector(layout, caches, token, tls)
    if backend == "grpc":
        from kvtransfer.grpc_backend import GrpcConnector
        return GrpcConnector(layout, caches, token, tls)
    raise ValueError(f"KV transfer backend {backend!r} is not one of 'nixl', 'grpc'")
