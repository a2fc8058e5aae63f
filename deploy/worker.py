"""Start one worker process of a deployment: the role's section of the config becomes a
WorkerSpec, and the role's package starts the process.

The same entry point serves every launcher (local processes, Ray actors, Kubernetes pods):
`pdspec worker --role prefill|decode|aggregated --config FILE --router ADDR` (ADDR: the
router's registry, host:router.internal_port).
"""

from decode_worker.main import start_decode_worker
from deploy.config import WILDCARD_HOSTS, DeploymentConfig
from prefill_worker.main import start_prefill_worker
from serving.roles import WORKER_ROLES
from serving.worker_process import RunningWorker, WorkerSpec


def start_worker(config: DeploymentConfig, role: str, router_address: str, host: str = "127.0.0.1",
                 advertise_host: str | None = None, worker_id: str | None = None) -> RunningWorker:
    if role not in WORKER_ROLES:
        raise ValueError(f"role: {role!r} is not one of {', '.join(WORKER_ROLES)}")
    if host in WILDCARD_HOSTS and not advertise_host:  # it would register an address every peer dials itself at
        raise ValueError(f"--advertise-host: required with --host {host or '(every interface)'}: the address the "
                         "router and other workers reach this worker at (e.g. this node's IP)")
    role_config = getattr(config, role)
    spec = WorkerSpec(
        role=role,
        # The schema keeps these two per role (DeploymentConfig refuses them under engine).
        engine=config.engine.model_copy(update={"num_threads": role_config.num_threads,
                                                "tensor_parallel_size": role_config.tensor_parallel_size}),
        router_address=router_address, token=config.token(), tls=config.tls_identity(),
        heartbeat_interval_s=config.router.heartbeat_interval_s,
        port=role_config.port, metrics_port=role_config.metrics_port, host=host, advertise_host=advertise_host,
        worker_id=worker_id,
    )
    if role == "prefill":
        return start_prefill_worker(spec, role_config.kv_transfer, config.pin_timeout_s)
    kv_transfer = role_config.kv_transfer if role == "decode" else None
    # A prefilled request's blocks stay pinned pin_timeout_s from its prefill: its wait for room on
    # a decode worker ends with half of that left for the pull (a pull finding them unpinned would
    # blame a healthy prefill worker); RESOURCE_EXHAUSTED then, and the router tries another one.
    admission_timeout_s = min(config.router.request_timeout_s, config.pin_timeout_s / 2)
    return start_decode_worker(spec, kv_transfer, admission_timeout_s=admission_timeout_s)
