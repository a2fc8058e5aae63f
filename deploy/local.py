"""`pdspec serve` without Ray: the router and every worker as separate processes on this machine.

The router starts first; workers register with it. The cluster counts as up once the router
answers health checks and lists every worker; from then on a process that dies is restarted
(deploy/supervisor.py). Stopping terminates all of them (SIGTERM, then SIGKILL after a grace
period), also when the launcher itself is interrupted.
"""

import os
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from deploy.config import ConfigError, DeploymentConfig, check_launchable, with_fixed_ports
from deploy.readiness import list_workers, wait_for_workers
from deploy.supervisor import Supervisor
from proto.pdspec.v1 import router_pb2
from proto.rpc import free_port, wait_healthy
from serving.roles import WORKER_ROLES


@dataclass
class LocalCluster:
    config: DeploymentConfig
    router_port: int
    host: str = "127.0.0.1"
    log_level: str | None = None  # the router's and workers' (--log-level); None: their defaults
    supervisor: Supervisor = field(default_factory=Supervisor)
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pdspec-logs-")))

    def __post_init__(self) -> None:
        # The router listens on router.host itself (its config); the rest of a one-machine cluster
        # (workers, health checks, printed addresses) uses loopback for a wildcard: workers listened
        # on every interface and registered 0.0.0.0, which peers reached only as Linux's alias.
        if self.host == "0.0.0.0":
            self.host = "127.0.0.1"
        self.config = with_fixed_ports(self.config, any_internal_port=not self.router_port)
        self.router_port = self.router_port or free_port(self.host)  # 0: any free port
        self.token = self.config.token() or os.urandom(16).hex()  # internal RPCs' (ListWorkers too)
        self.tls = self.config.tls_identity()

    @property
    def router_address(self) -> str:
        return f"{self.host}:{self.router_port}"

    @property
    def registry_address(self) -> str:
        """Where workers register (the router's internal port)."""
        return f"{self.host}:{self.config.router.internal_port}"

    @property
    def http_url(self) -> str | None:
        """The OpenAI API's base URL (None: router.http_port is off)."""
        return self.config.http_url(self.host)

    def start(self, timeout_s: float = 300.0) -> "LocalCluster":
        """Start everything; if any part fails to come up, stop what did before raising."""
        check_launchable(self.config)
        check_one_machine_ports(self.config)
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout_s: float) -> None:
        threads, gpus = default_threads(self.config), cuda_devices(self.config, os.environ)
        config_file = self.log_dir / "config.yaml"
        config_file.write_text(yaml.safe_dump(self.config.model_dump(mode="json")))
        env = {**os.environ, "PDSPEC_CLUSTER_TOKEN": self.token}
        self._spawn("router", ["router", "--config", str(config_file), "--port", str(self.router_port)], env)
        deadline = time.monotonic() + timeout_s
        while True:  # a router that exits (a bad config, a taken port) is reported at once, with its log
            self._check_alive()
            try:
                wait_healthy(self.router_address, min(1.0, max(deadline - time.monotonic(), 0.1)), self.tls)
                break
            except TimeoutError as e:  # its message names the last try's second, not the whole wait
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the router did not become healthy within {timeout_s:g} s "
                                       f"(--start-timeout); the last check: {e}; logs in {self.log_dir}") from None
        for role in WORKER_ROLES:
            for i in range(getattr(self.config, role).replicas):
                name = f"{role}-{i}"
                args = ["worker", "--role", role, "--config", str(config_file), "--router", self.registry_address,
                        "--host", self.host, "--worker-id", name]
                # NIXL logs INFO to stdout by default; UCX would also listen beyond loopback.
                self._spawn(name, args, {**env, "OMP_NUM_THREADS": str(threads[role]), "NIXL_LOG_LEVEL": "WARN",
                                         "UCX_NET_DEVICES": env.get("UCX_NET_DEVICES", "lo")} | gpus.get(name, {}))
        wait_for_workers(self.router_address, self.token, [n for n in self.supervisor.names() if n != "router"],
                         timeout_s, self._check_alive, f"logs in {self.log_dir}", self.tls)
        self.supervisor.supervise()

    def workers(self) -> dict[str, router_pb2.WorkerStatus]:
        """What the router lists now, by worker id."""
        return list_workers(self.router_address, self.token, self.tls)

    def _check_alive(self) -> None:
        dead = self.supervisor.dead()
        if dead:
            # The last lines of the first casualty's log usually say why (CI keeps no log dirs).
            tail = (self.log_dir / f"{dead[0]}.log").read_text(errors="replace").splitlines()[-8:]
            raise RuntimeError(f"{', '.join(dead)} exited during start-up; logs in {self.log_dir}; "
                               f"{dead[0]}.log ends:\n" + "\n".join(tail))

    def kill(self, name: str) -> None:
        """Kill one process abruptly (SIGKILL), as a crash would; it is restarted."""
        self.supervisor.signal(name, signal.SIGKILL, wait=True)

    def roll(self, name: str) -> None:
        """SIGTERM one worker, as a rolling restart does: it deregisters, finishes what it runs
        (its role's drain_timeout_s), exits and is restarted."""
        self.supervisor.signal(name, signal.SIGTERM)

    def stop(self, grace_s: float | None = None) -> None:
        """Workers first (they deregister and drain while the router is still up), then the router.
        `grace_s`: before SIGKILL (default: the longest drain_timeout_s, the router's too, plus 5 s)."""
        if grace_s is None:
            grace_s = self.config.longest_drain_timeout_s() + 5.0
        self.supervisor.stop(first=[n for n in self.supervisor.names() if n != "router"], grace_s=grace_s)

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        level = ["--log-level", self.log_level] if self.log_level else []
        self.supervisor.spawn(name, level + args, env, self.log_dir / f"{name}.log")


def check_one_machine_ports(config: DeploymentConfig) -> None:
    """Processes on one machine cannot share a fixed port (the second would fail to bind, restarted
    forever): neither a role's replicas nor two roles, nor a role and the router. Raises
    ConfigError naming the fields."""
    rc = config.router
    taken = {port: f"router.{name}" for name, port in (("port", rc.port), ("internal_port", rc.internal_port),
                                                       ("http_port", rc.http_port)) if port}
    for role in WORKER_ROLES:
        rc = getattr(config, role)
        for name in ("port", "metrics_port"):
            port = getattr(rc, name)
            if not rc.replicas or not port:
                continue
            if rc.replicas > 1:
                raise ConfigError(f"{role}.{name}: {port} is fixed, but the {rc.replicas} replicas on this machine "
                                  "cannot all listen on it: set 0 (any free port)")
            if port in taken:
                raise ConfigError(f"{role}.{name}: {port} is {taken[port]} too, on this machine: give each its own "
                                  "port, or 0 (any free port)")
            taken[port] = f"{role}.{name}"


def cuda_devices(config: DeploymentConfig, environ: dict[str, str]) -> dict[str, dict[str, str]]:
    """With engine.device cuda, each worker's CUDA_VISIBLE_DEVICES: its own tensor_parallel_size
    GPUs of those visible here, in order (without it every replica ran on GPU 0). Raises
    ConfigError when the replicas need more GPUs than there are."""
    if config.engine.device != "cuda":
        return {}
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        import torch

        visible = ",".join(str(i) for i in range(torch.cuda.device_count()))
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    wanted = [(f"{role}-{i}", getattr(config, role).tensor_parallel_size)
              for role in WORKER_ROLES for i in range(getattr(config, role).replicas)]
    if sum(n for _, n in wanted) > len(devices):
        raise ConfigError(f"the replicas need {sum(n for _, n in wanted)} GPUs (tensor_parallel_size each), this "
                          f"machine shows {len(devices)}: lower a role's replicas or tensor_parallel_size")
    assigned, first = {}, 0
    for name, n in wanted:
        assigned[name] = {"CUDA_VISIBLE_DEVICES": ",".join(devices[first : first + n])}
        first += n
    return assigned


def default_threads(config: DeploymentConfig, cores: int | None = None) -> dict[str, int]:
    """Threads per tensor-parallel rank: the configured number, else the cores but one split evenly
    between replicas, then between a replica's ranks (at least one each). OpenMP threads of processes sharing a core would spin against
    each other; and the router, the fronts and the clients of a local cluster run on this machine
    too: a team on every core waits at each of a step's ~150 barriers whenever one of them
    preempts a member (on 2 cores, an aggregated worker with both decoded a chat load at 7.5-8 ms
    a token, with one at 3.5)."""
    replicas = sum(getattr(config, r).replicas for r in WORKER_ROLES)
    share = max(1, ((cores or os.cpu_count() or 1) - 1) // max(1, replicas))
    return {r: getattr(config, r).num_threads or max(1, share // getattr(config, r).tensor_parallel_size)
            for r in WORKER_ROLES}
