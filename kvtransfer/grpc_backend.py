"""KV transfer over the PullBlocks gRPC stream: works wherever gRPC does, no NIXL needed.

One message per (block, cache) keeps every message one block long; HTTP/2 flow control paces
the source to the speed at which we verify and copy. Each chunk's XXH3-64 is checked before its
bytes land in the local cache.
"""

import grpc
import xxhash

from kvtransfer.connector import BaseConnector, Cancellation, KVTransferError, remaining, rpc_failure
from kvtransfer.layout import layout_to_proto, write_block
from proto.pdspec.v1 import kv_pb2, kv_pb2_grpc


BUSY_WAIT_S, BUSY_WAIT_MAX_S = 0.02, 0.5  # between pulls a busy source refused, doubling


class GrpcConnector(BaseConnector):
    needs_release_proof = False  # the source copied each chunk while its pin held it (a pin gone: NOT_FOUND)

    def _move(self, stub: kv_pb2_grpc.KVTransferStub, handle: kv_pb2.KVHandle, remote_block_ids: list[int],
              local_block_ids: list[int], deadline: float, cancel: Cancellation) -> None:
        local_of = dict(zip(remote_block_ids, local_block_ids))
        missing = {(block_id, cache) for block_id in remote_block_ids for cache in self.caches}
        request = kv_pb2.PullBlocksRequest(request_id=handle.request_id, block_ids=remote_block_ids,
                                            expected_layout=layout_to_proto(self.layout), pin_id=handle.pin_id)
        wait_s = BUSY_WAIT_S
        while True:
            stream, received = stub.PullBlocks(request, timeout=remaining(deadline)), False
            cancel.on_set(stream.cancel)
            try:
                for chunk in stream:
                    received = True
                    self._verify(chunk, missing, handle.source_address)
                    write_block(self.caches[chunk.cache], local_of[chunk.block_id], chunk.data)
                    missing.discard((chunk.block_id, chunk.cache))
                break
            except grpc.RpcError as e:
                if cancel.is_set():
                    raise KVTransferError(f"PullBlocks of {handle.request_id} cancelled", retryable=True) from None
                # A source serving its most pulls at once (it refuses before any chunk): its turn
                # comes, the pin holds meanwhile; blamed, a healthy busy source would be written off.
                busy = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not received
                if not busy or remaining(deadline) < 2 * wait_s:  # (a try after the wait needs time too)
                    raise rpc_failure(e, f"PullBlocks of {handle.request_id}", handle.source_address) from None
            finally:
                stream.cancel()  # no-op after a complete stream; frees it at once when we stop early
            if cancel.wait(wait_s):
                raise KVTransferError(f"PullBlocks of {handle.request_id} cancelled", retryable=True)
            wait_s = min(2 * wait_s, BUSY_WAIT_MAX_S)
        if missing:
            raise KVTransferError(f"{handle.source_address} ended PullBlocks of {handle.request_id} "
                                  f"with {len(missing)} (block, cache) chunks missing", retryable=True)

    def _verify(self, chunk: kv_pb2.KVBlockChunk, missing: set[tuple[int, str]], source: str) -> None:
        where = f"block {chunk.block_id} ({chunk.cache}) from {source}"
        if (chunk.block_id, chunk.cache) not in missing:
            raise KVTransferError(f"{where} was not asked for or came twice", retryable=True)
        if len(chunk.data) != self.block_bytes[chunk.cache]:
            raise KVTransferError(f"{where} has {len(chunk.data)} bytes, expected {self.block_bytes[chunk.cache]}",
                                  retryable=True)
        if xxhash.xxh3_64_intdigest(chunk.data) != chunk.checksum:
            raise KVTransferError(f"{where} failed its XXH3-64 checksum: corrupted in transit", retryable=True)
