"""Start one worker process's parts: engine, engine loop, its gRPC services, router registration.

The same entry point serves every launcher (local processes, Ray actors, Kubernetes pods):
`pdspec worker --role prefill|decode|aggregated --config FILE --router ADDR`.
"""

import logging
import socket
import uuid
from dataclasses import dataclass

import grpc

from decode_worker.service import DecodeServicer
from deploy.config import DeploymentConfig
from serving.metrics import serve_metrics
from engine.engine import Engine
from engine.loop import EngineLoop
from kvtransfer.backends import make_connector
from kvtransfer.connector import KVConnector
from kvtransfer.layout import layout_to_proto
from kvtransfer.source import KVSource
from prefill_worker.service import PrefillServicer
from proto.pdspec.v1 import kv_pb2_grpc, worker_pb2_grpc
from serving.registry_client import RegistryClient, registration
from serving.roles import WORKER_ROLES
from proto.rpc import serve

log = logging.getLogger(__name__)


@dataclass
class RunningWorker:
    worker_id: str
    role: str
    address: str
    server: grpc.Server
    loop: EngineLoop
    registry: RegistryClient
    source: KVSource | None
    connector: KVConnector | None
    metrics_server: object

    def stop(self) -> None:
        self.registry.stop()
        self.server.stop(grace=2).wait()
        self.metrics_server.shutdown()
        for transfer in (self.source, self.connector):
            if transfer is not None:
                transfer.close()
        self.loop.stop()
        self.loop.engine.close()


def start_worker(config: DeploymentConfig, role: str, router_address: str, host: str = "127.0.0.1",
                 advertise_host: str | None = None, worker_id: str | None = None) -> RunningWorker:
    if role not in WORKER_ROLES:
        raise ValueError(f"role: {role!r} is not one of {', '.join(WORKER_ROLES)}")
    role_config = getattr(config, role)
    # The schema keeps these two per role (DeploymentConfig refuses them under engine).
    engine = Engine(config.engine.model_copy(update={"num_threads": role_config.num_threads,
                                                      "tensor_parallel_size": role_config.tensor_parallel_size}))
    loop = EngineLoop(engine)
    runner = engine.runner
    caches = {"target": runner.kv_cache} | ({"draft": runner.draft_cache} if runner.draft_cache is not None else {})
    token = config.token()
    worker_id = worker_id or f"{role}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    layout = layout_to_proto(runner.layout)
    source = connector = None
    if role == "prefill":
        source = KVSource(runner.layout, caches, config.pin_timeout_s, nixl=role_config.kv_transfer == "nixl")
        servicer = PrefillServicer(loop, source, worker_id, "", layout)
        services = [
            (worker_pb2_grpc.add_PrefillWorkerServicer_to_server, servicer, "pdspec.v1.PrefillWorker"),
            (kv_pb2_grpc.add_KVTransferServicer_to_server, source.servicer, "pdspec.v1.KVTransfer"),
        ]
    else:
        connector = make_connector(role_config.kv_transfer, runner.layout, caches, token) if role == "decode" else None
        servicer = DecodeServicer(loop, connector, admission_timeout_s=config.router.request_timeout_s)
        services = [(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, servicer, "pdspec.v1.DecodeWorker")]
    server, bound = serve(services, f"{host}:{role_config.port}", token, internal=[name for _, _, name in services])
    address = f"{advertise_host or host}:{bound}"
    servicer.address = address  # handles name the address other workers reach us at
    metrics_server, metrics_port = serve_metrics(loop, role, worker_id, host, role_config.metrics_port)
    request = registration(worker_id, role, address, layout, engine.blocks.num_blocks, engine.max_model_len)
    request.metrics_address = f"{advertise_host or host}:{metrics_port}"
    registry = RegistryClient(router_address, token, request, loop, interval_s=config.router.heartbeat_interval_s)
    registry.start()
    log.info("%s worker %s serving on %s (model %s, draft %s, K=%d, %d KV blocks, transfer %s)",
             role, worker_id, address, runner.model_dir, config.engine.speculative.model or
             ("embedded" if runner.draft else "none"), engine.num_speculative_tokens, engine.blocks.num_blocks,
             role_config.kv_transfer)
    return RunningWorker(worker_id, role, address, server, loop, registry, source, connector, metrics_server)
