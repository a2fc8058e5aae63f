"""`pdspec serve` on Ray: the router and every worker replica as Ray actors, one process each.

- The router actor is pinned to the launcher's node on a fixed port, so a worker that Ray
  restarts after a crash (every actor has max_restarts=-1) finds it at the same address; the
  worker keeps its actor name as its worker id, so it re-registers in its old place.
- A replica asks Ray for its role's resources: CPUs, GPUs (Ray sets CUDA_VISIBLE_DEVICES to
  them), memory, custom resources. Tensor-parallel ranks are child processes of the worker, rank
  i driving the i-th visible GPU, so one actor holding all of a replica's GPUs is the placement:
  Ray never splits one actor's resources over nodes.
- Actors are named in the Ray namespace "pdspec": `pdspec stop` finds a detached deployment
  again, and a second deployment on the same cluster is refused.
"""

import contextlib
import logging
import math
import os
import signal
from collections.abc import Callable
from typing import TypeVar

# Ray rewrites 127.0.0.1 to the host's outward address (so that other machines could join)
# unless this is off, and the private Ray of start() would then listen beyond loopback. It only
# changes how "localhost" is resolved (here and in the Ray we start): a cluster's own address is
# used as given. Ray reads it once, at import.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from deploy.config import (WILDCARD_HOSTS, ConfigError, DeploymentConfig, RoleConfig, check_launchable,
                           with_fixed_ports)
from deploy.logs import configure_logging
from deploy.readiness import list_workers, wait_for_workers
from engine.procfs import child_pids
from proto.pdspec.v1 import router_pb2
from proto.rpc import free_port, wait_healthy
from serving.roles import WORKER_ROLES

log = logging.getLogger(__name__)
T = TypeVar("T")

NAMESPACE = "pdspec"
ROUTER = "router"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
# Resources fields -> (Ray resource, Ray units per field unit, unit in messages)
_FIELDS = {"cpus": ("CPU", 1, " CPUs"), "gpus": ("GPU", 1, " GPUs"), "memory_gb": ("memory", 2**30, " GB")}


def _where() -> dict:
    return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}


# Router and engine modules are imported inside the actors: the launcher (and `pdspec stop`)
# need not load torch.
@ray.remote(max_restarts=-1)
class RouterActor:
    def __init__(self, config: DeploymentConfig, port: int, log_level: str | None):
        from engine.model_dir import resolve_model_dir
        from router.main import run_router

        configure_logging(log_level, server=True)  # Ray sets up its own logger only: ours were dropped

        tokenizer_dir = resolve_model_dir(config.engine.model, tokenizer_only=True)
        self.router = run_router(config.router, config.token(), tokenizer_dir, config.served_model_name(), port,
                                 tls=config.tls_identity())
        self.drain_timeout_s = config.router.drain_timeout_s

    def info(self) -> dict:
        return _where()

    def drain_timeout(self) -> float:
        return self.drain_timeout_s

    def stop(self) -> None:
        self.router.stop(self.drain_timeout_s)


@ray.remote(max_restarts=-1)
class WorkerActor:
    def __init__(self, config: DeploymentConfig, role: str, router_address: str, worker_id: str,
                 log_level: str | None):
        from deploy.worker import start_worker

        configure_logging(log_level, server=True)

        # Bind the address Ray knows this node by: decode workers reach prefill workers there.
        self.worker = start_worker(config, role, router_address, host=ray.util.get_node_ip_address(),
                                   worker_id=worker_id)
        self.drain_timeout_s = getattr(config, role).drain_timeout_s

    def info(self) -> dict:
        return _where() | {"address": self.worker.address}

    def drain_timeout(self) -> float:
        return self.drain_timeout_s

    def drain(self) -> None:
        """Deregister, finish what runs (up to the role's drain_timeout_s), shut down; the actor
        is killed after. Ray's actors run one call at a time unless told otherwise, and this is
        the last."""
        self.worker.stop(drain_timeout_s=self.drain_timeout_s)


def replica_options(role: RoleConfig) -> dict:
    """Ray actor options for one replica of `role`: its resources, and OpenMP threads split over
    its tensor-parallel ranks (child processes inherit the environment)."""
    r = role.resources
    threads = role.num_threads or max(1, math.floor(r.cpus / role.tensor_parallel_size))
    return {"num_cpus": r.cpus, "num_gpus": r.gpus, "memory": int(r.memory_gb * 2**30) if r.memory_gb else None,
            "resources": dict(r.custom),
            "env_vars": {"OMP_NUM_THREADS": str(threads), "NIXL_LOG_LEVEL": "WARN"}}  # NIXL logs INFO by default


def check_feasible(config: DeploymentConfig, nodes: list[dict[str, float]]) -> None:
    """Raise ConfigError naming every resource field one replica asks more of than the largest
    of `nodes` (Ray resource dicts) has, as such a replica would wait for placement forever."""
    errors = []
    for role in WORKER_ROLES:
        rc = getattr(config, role)
        r = rc.resources
        if not rc.replicas:
            continue
        if config.engine.device == "cuda" and r.gpus != rc.tensor_parallel_size:
            errors.append(f"{role}.resources.gpus: {r.gpus} GPUs per replica, but engine.device is cuda with "
                          f"tensor_parallel_size {rc.tensor_parallel_size}: each rank drives one GPU")
        demand = {"cpus": r.cpus, "gpus": r.gpus, "memory_gb": r.memory_gb or 0} | {
            f"custom.{k}": v for k, v in r.custom.items()}
        for field, need in demand.items():
            key, scale, unit = _FIELDS.get(field, (field.removeprefix("custom."), 1, ""))
            have = max((n.get(key, 0.0) for n in nodes), default=0.0) / scale
            if need > have:
                errors.append(f"{role}.resources.{field}: {need:g}{unit} per replica, "
                              f"but the largest node has {have:.3g}")
    if errors:
        raise ConfigError("; ".join(errors))


class RayCluster:
    """A deployment of `config` on Ray. `address` is a running cluster's ("127.0.0.1:6379",
    "auto"); None starts a private single-machine Ray on loopback. A `detached` deployment
    outlives this process until `stop_deployment` ends it."""

    def __init__(self, config: DeploymentConfig, router_port: int, address: str | None = None,
                 detached: bool = False, log_level: str | None = None):
        self.config, self.address, self.detached, self.log_level = config, address, detached, log_level
        # Fixed even when the config says 0: restarted workers must find the router again.
        self.router_port = router_port or free_port(config.router.host)
        self.config = with_fixed_ports(config, any_internal_port=not router_port)  # the same for the others
        self.tls = self.config.tls_identity()
        self.router_address = ""  # set by start(): a wildcard host resolves to the router's node
        self.actors: dict[str, ActorHandle] = {}
        self._ready: dict[str, ray.ObjectRef] = {}  # resolves once the actor's constructor returned
        self._connected = False
        self.token = config.token() or os.urandom(16).hex()  # internal RPCs' (ListWorkers too)
        # The actors get the token inside their pickled config, not as an environment variable:
        # Ray's state API and dashboard list every actor's runtime_env.
        self._actor_config = self.config.model_copy(update={"cluster_token": self.token})

    @property
    def http_url(self) -> str | None:
        """The OpenAI API's base URL, on the router's node (None: router.http_port is off)."""
        return self.config.http_url(self.router_address.rsplit(":", 1)[0])

    def start(self, timeout_s: float = 300.0) -> "RayCluster":
        """Check the config against the cluster, place the router and workers, wait until all
        serve. A config that cannot run fails before any actor exists; on any later failure the
        actors created so far are killed."""
        check_launchable(self.config)
        self._connected = _connect(self.address)
        try:
            nodes = [n for n in ray.nodes() if n["Alive"]]
            check_feasible(self.config, [n["Resources"] for n in nodes])
            _check_router_reachable(self.config.router.host, {n["NodeManagerAddress"] for n in nodes})
            if running := _deployed():
                raise RuntimeError(f"a pdspec deployment is already running on this Ray cluster "
                                   f"({', '.join(running)}); end it with `pdspec stop`")
            host = self.config.router.host
            router_host = ray.util.get_node_ip_address() if host in WILDCARD_HOSTS else host
            self.router_address = f"{router_host}:{self.router_port}"
            self.registry_address = f"{router_host}:{self.config.router.internal_port}"
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            self._launch(ROUTER, RouterActor.options(num_cpus=0, scheduling_strategy=here, **self._named(ROUTER, {}))
                         .remote(self._actor_config, self.router_port, self.log_level))
            self._check(ROUTER, timeout_s)  # the router fails alone, before any worker loads a model
            for role in WORKER_ROLES:
                for i in range(getattr(self.config, role).replicas):
                    self._start_worker(role, f"{role}-{i}")
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Router healthy and every worker listed by it; raises if an actor failed to start."""
        wait_healthy(self.router_address, timeout_s, self.tls)
        wait_for_workers(self.router_address, self.token, [n for n in self.actors if n != ROUTER], timeout_s,
                         self._check_all, "actor logs are in the Ray session's logs directory (worker-*.err)", self.tls)

    def workers(self) -> dict[str, router_pb2.WorkerStatus]:
        """What the router lists now, by worker id."""
        return list_workers(self.router_address, self.token, self.tls)

    def kill(self, name: str) -> None:
        """Kill one actor as a crash would; Ray restarts it."""
        ray.kill(self.actors[name], no_restart=False)

    def stop(self) -> None:
        """Drain and end our actors (workers first, as on SIGTERM), then disconnect (which ends a
        Ray that start() started). An actor still starting is killed at once."""
        if self._ready:
            done, _ = ray.wait(list(self._ready.values()), num_returns=len(self._ready), timeout=0)
            started = {name for name, ref in self._ready.items() if ref in done}
            _drain_and_kill(self.actors, self.config.longest_drain_timeout_s(), started)
        self.disconnect()

    def disconnect(self) -> None:
        """Leave the deployment to Ray. Detached actors run on; the others die with this driver."""
        self.actors.clear()
        self._ready.clear()
        if self._connected:
            ray.shutdown()
            self._connected = False

    def _start_worker(self, role: str, name: str) -> None:
        options = replica_options(getattr(self.config, role))
        options |= self._named(name, options.pop("env_vars"))
        self._launch(name, WorkerActor.options(**options).remote(self._actor_config, role, self.registry_address, name,
                                                                 self.log_level))

    def _named(self, name: str, env: dict[str, str]) -> dict:
        # One host (a private Ray's node is loopback, whatever router.host says): keep UCX (NIXL) off
        # other interfaces too.
        if self.address is None or self.config.router.host in _LOOPBACK:
            env = env | {"UCX_NET_DEVICES": "lo"}
        return {"name": name, "namespace": NAMESPACE, "lifetime": "detached" if self.detached else None,
                "runtime_env": {"env_vars": env}}

    def _launch(self, name: str, actor: ActorHandle) -> None:
        self.actors[name] = actor
        self._ready[name] = actor.info.remote()

    def _check(self, name: str, timeout_s: float) -> None:
        try:
            ray.get(self._ready[name], timeout=timeout_s)
        except ray.exceptions.RayActorError as e:  # a constructor that raised is not restarted
            raise RuntimeError(f"{name} failed to start: {e}") from None

    def _check_all(self) -> None:
        done, _ = ray.wait(list(self._ready.values()), num_returns=len(self._ready), timeout=0)
        for name, ref in self._ready.items():
            if ref in done:
                self._check(name, 0)


def stop_deployment(address: str | None = None) -> list[str]:
    """`pdspec stop`: kill every actor of the pdspec deployment on the Ray cluster at `address`
    (None: the one `ray start` last recorded on this machine); returns their names."""
    connected = _connect(address or "auto")
    try:
        names = _deployed()
        actors = {name: ray.get_actor(name, namespace=NAMESPACE) for name in names}
        # The deployment's own drain times (its config is not here): the schema's were too short
        # for a deployment that raised them, whose streams were cut.
        try:
            asked = [actor.drain_timeout.remote() for actor in actors.values()]
            drain_s = max(ray.get(asked, timeout=30), default=0.0)
        except (ray.exceptions.RayError, TimeoutError, AttributeError):  # no answer, or an older version's actors
            drain_s = RoleConfig.model_fields["drain_timeout_s"].default
        _drain_and_kill(actors, drain_s, set(actors))
        return names
    finally:
        if connected:
            ray.shutdown()


def _drain_and_kill(actors: dict[str, ActorHandle], drain_s: float, started: set[str]) -> None:
    """The `started` workers drain first (they deregister and finish their streams while the
    router still relays them), then the router stops; every actor is killed after, also one that
    did not drain in time (`drain_s`, the longest drain_timeout_s, the router's too, plus 15 s)."""
    ours = {name: actor for name, actor in actors.items() if name in started}
    for method, group in (("drain", [a for n, a in ours.items() if n != ROUTER]), ("stop", [ours.get(ROUTER)])):
        refs = [getattr(actor, method).remote() for actor in group if actor is not None]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=drain_s + 15)
    for actor in actors.values():
        ray.kill(actor, no_restart=True)


def _connect(address: str | None) -> bool:
    """Connect this process to Ray unless it already is; True if we connected."""
    if ray.is_initialized():
        return False
    if address is None:
        _start_local_ray()
        return True
    try:
        ray.init(address=address, namespace=NAMESPACE)
    except ConnectionError as e:  # the CLI says it as an error, not a traceback
        raise RuntimeError(f"cannot connect to the Ray cluster (--address {address}): {e}") from None
    return True


def _start_local_ray(attempts: int = 3) -> None:
    """A new private single-machine Ray ("local": never one that `ray start` recorded; pdspec
    exports its own metrics, so no dashboard)."""
    def start() -> None:
        try:
            ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, namespace=NAMESPACE)
        except BaseException:
            with contextlib.suppress(Exception):  # its own error must not hide Ray's
                ray.shutdown()
            raise

    start_ray_again_on_missed_window(start, attempts)


def start_ray_again_on_missed_window(start: Callable[[], T], attempts: int = 3) -> T:
    """`start()`'s result. Ray gives each node's raylet a fixed 30 s to register (not
    configurable), which a loaded 2-core host sometimes misses, twice in a row once in clean-clone
    CI: that attempt's processes are killed (`start` undoes what it knows of itself), and Ray
    started again, up to `attempts` times. A start that fails for good leaves nothing running either."""
    attempt = 1
    while True:
        before = child_pids()
        try:
            return start()
        except BaseException as e:  # Ray raises a bare Exception for a missed start-up; Ctrl-C cleans up too
            for pid in child_pids() - before:  # the half-started GCS and raylet (theirs die with them)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if "timed out during startup" not in str(e) or attempt >= attempts:
                raise
            log.warning("Ray's node missed its start-up window (%s); starting it again", e)
            attempt += 1


def _deployed() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE)


def _check_router_reachable(host: str, node_ips: set[str]) -> None:
    if host in _LOOPBACK and node_ips - {ray.util.get_node_ip_address()}:
        raise ConfigError(f"router.host: {host} is loopback, but workers may run on other nodes "
                          f"({', '.join(sorted(node_ips))}); use 0.0.0.0 or this node's address")
