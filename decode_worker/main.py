"""A decode worker process (or an aggregated one, which prefills its own prompts and pulls
nothing): the engine, the KV connector that pulls prompt blocks, and the DecodeWorker service."""

from typing import Literal

from decode_worker.service import DecodeServicer
from kvtransfer.backends import make_connector
from proto.pdspec.v1 import worker_pb2_grpc
from serving.metrics import HandoffMetrics
from serving.worker_process import RunningWorker, WorkerSpec, announce, bind, kv_caches, start_engine


def start_decode_worker(spec: WorkerSpec, kv_transfer: Literal["nixl", "grpc"] | None,
                        admission_timeout_s: float) -> RunningWorker:
    """kv_transfer None: an aggregated worker."""
    loop = start_engine(spec)
    connector = None
    if kv_transfer is not None:
        connector = make_connector(kv_transfer, loop.engine.runner.layout, kv_caches(loop), spec.token, spec.tls)
    handoffs = HandoffMetrics(spec.worker_id)
    servicer = DecodeServicer(loop, connector, handoffs, admission_timeout_s=admission_timeout_s)
    server, address, health = bind(spec, loop, [(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, servicer,
                                         "pdspec.v1.DecodeWorker")])
    return announce(spec, loop, server, address, health, [connector] if connector else [], kv_transfer or "none",
                    servicer.calls, collectors=[handoffs])
