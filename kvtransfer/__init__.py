"""KV block transfer from a prefill worker (source) to a decode worker (destination).

The source pins a prompt's blocks (`source.KVSource`) and serves them over the KVTransfer gRPC
service; the destination pulls the blocks it lacks through a `connector.KVConnector`, over NIXL
(one-sided READs) or over the gRPC stream itself, then releases the source's pin.
"""
