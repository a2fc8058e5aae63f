"""A prefill worker process: the engine, the KV source that pins and serves prompt blocks, and
the PrefillWorker and KVTransfer services."""

from typing import Literal

from kvtransfer.source import KVSource
from prefill_worker.service import PrefillServicer
from proto.pdspec.v1 import kv_pb2_grpc, worker_pb2_grpc
from serving.call_limit import kv_pull_limit, request_call_limit
from serving.worker_process import RunningWorker, WorkerSpec, announce, bind, kv_caches, layout_message, start_engine


def start_prefill_worker(spec: WorkerSpec, kv_transfer: Literal["nixl", "grpc"], pin_timeout_s: float) -> RunningWorker:
    loop = start_engine(spec)
    source = KVSource(loop.engine.runner.layout, kv_caches(loop), pin_timeout_s, nixl=kv_transfer == "nixl",
                      token=spec.token, pull_slots=kv_pull_limit(request_call_limit(spec.engine.max_num_seqs)).held)
    servicer = PrefillServicer(loop, source, spec.worker_id, "", layout_message(loop))
    server, address, health = bind(spec, loop, [
        (worker_pb2_grpc.add_PrefillWorkerServicer_to_server, servicer, "pdspec.v1.PrefillWorker"),
        (kv_pb2_grpc.add_KVTransferServicer_to_server, source.servicer, "pdspec.v1.KVTransfer"),
    ])
    servicer.address = address  # handles name the address decode workers pull from
    return announce(spec, loop, server, address, health, [source], kv_transfer, servicer.calls)
