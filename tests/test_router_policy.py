"""Routing policies: the kv cost model, its sampling, the baselines and the decode choice."""

import random
from collections import Counter

from router.config import RouterConfig
from proto.pdspec.v1 import kv_pb2, worker_pb2
from router.policy import KVPolicy, RandomPolicy, RoundRobinPolicy, least_loaded, make_policy
from router.registry import Registry, WorkerView


def view(worker_id: str, active: int = 0, total: int = 100, running: int = 0, waiting: int = 0) -> WorkerView:
    return WorkerView(worker_id=worker_id, role="prefill", address=f"{worker_id}:1", active_blocks=active,
                      total_blocks=total, running=running, waiting=waiting, cached_blocks=0, seconds_since_heartbeat=0.0,
                      metrics_address="", registration_id="")


def test_kv_prefers_the_worker_holding_a_long_shared_prefix():
    policy = KVPolicy(overlap_weight=1.0, temperature=0.0)
    workers = [view("a", active=3), view("b"), view("c", active=1)]
    assert policy.choose(workers, {"a": 10, "c": 2}, request_blocks=12).worker_id == "a"


def test_load_outweighs_overlap_unless_overlap_is_weighted_up():
    workers = [view("busy", active=50), view("idle")]
    overlaps = {"busy": 10}  # of 12 blocks: busy must prefill 2, idle 12
    assert KVPolicy(overlap_weight=1.0, temperature=0.0).choose(workers, overlaps, 12).worker_id == "idle"  # 52 > 12
    assert KVPolicy(overlap_weight=10.0, temperature=0.0).choose(workers, overlaps, 12).worker_id == "busy"  # 70 < 120


def test_equal_costs_go_to_fewer_requests_then_lower_id():
    policy = KVPolicy(overlap_weight=1.0, temperature=0.0)
    assert policy.choose([view("a", running=2), view("b", running=1), view("c", running=1)], {}, 4).worker_id == "b"
    # queued requests hold a prefill worker as running ones do
    assert policy.choose([view("a", waiting=2), view("b", running=1)], {}, 4).worker_id == "b"


def test_positive_temperature_samples_favouring_the_cheapest():
    workers = [view("cheap"), view("dear", active=8)]
    policy = KVPolicy(overlap_weight=1.0, temperature=0.5, rng=random.Random(0))
    picks = Counter(policy.choose(workers, {}, 4).worker_id for _ in range(400))
    # Normalized costs 0 and 1: P(dear) = e^-2 / (1 + e^-2) ~ 0.12
    assert 0.05 < picks["dear"] / 400 < 0.2
    cold = KVPolicy(overlap_weight=1.0, temperature=0.01, rng=random.Random(0))
    assert {cold.choose(workers, {}, 4).worker_id for _ in range(50)} == {"cheap"}


def test_round_robin_cycles_and_random_spreads():
    workers = [view("a"), view("b"), view("c")]
    rr = RoundRobinPolicy()
    assert [rr.choose(workers, {"a": 9}, 9).worker_id for _ in range(5)] == ["a", "b", "c", "a", "b"]
    rnd = RandomPolicy(random.Random(0))
    assert {rnd.choose(workers, {}, 1).worker_id for _ in range(60)} == {"a", "b", "c"}


def test_make_policy_follows_the_config():
    kv = make_policy(RouterConfig(policy="kv", overlap_weight=2.0, temperature=0.3))
    assert isinstance(kv, KVPolicy) and (kv.overlap_weight, kv.temperature) == (2.0, 0.3)
    assert isinstance(make_policy(RouterConfig(policy="round_robin")), RoundRobinPolicy)
    assert isinstance(make_policy(RouterConfig(policy="random")), RandomPolicy)


def test_decode_choice_is_the_emptiest_pool_then_fewest_running():
    assert least_loaded([view("a", active=50, total=100), view("b", active=60, total=200)]).worker_id == "b"
    assert least_loaded([view("a", active=10, running=3), view("b", active=10, running=2)]).worker_id == "b"
    # a request whose KV is still arriving is reported waiting: it holds its worker too
    assert least_loaded([view("a", active=10, running=1, waiting=1), view("b", active=10, running=1)]).worker_id == "b"


def _two_prefill_workers() -> Registry:
    registry = Registry()
    layout = kv_pb2.KVLayout(model="m", dtype="float32", block_size=4)
    for wid in ("a", "b"):
        registry.register(worker_pb2.RegisterRequest(worker_id=wid, role="prefill", address=f"{wid}:1",
                                                     layout=layout, total_blocks=100, max_model_len=64,
                                                     max_num_seqs=4))
    return registry


def test_a_burst_spreads_before_heartbeats_report_it():
    registry = _two_prefill_workers()
    policy = KVPolicy(overlap_weight=1.0, temperature=0.0)
    chosen = []
    for i in range(4):
        overlaps, blocks = registry.prefix_overlaps(list(range(16)))
        chosen.append(policy.choose(registry.workers(), overlaps, blocks).worker_id)
        registry.note_routed([chosen[-1]], f"r{i}", blocks)
    assert chosen == ["a", "b", "a", "b"]


def test_a_workers_queue_counts_as_its_load_after_heartbeats():
    """Queued requests' blocks are not allocated yet: a heartbeat reporting only the used ones made
    a backlogged worker look idle, and it took the next burst too."""
    registry = _two_prefill_workers()
    queued = worker_pb2.Load(active_blocks=2, total_blocks=100, running=1, waiting=3, waiting_blocks=12)
    idle = worker_pb2.Load(active_blocks=4, total_blocks=100, running=1)
    registry.heartbeat(worker_pb2.HeartbeatRequest(worker_id="a", load=queued))
    registry.heartbeat(worker_pb2.HeartbeatRequest(worker_id="b", load=idle))
    views = {v.worker_id: v for v in registry.workers()}
    assert (views["a"].active_blocks, views["b"].active_blocks) == (14, 4)
    overlaps, blocks = registry.prefix_overlaps(list(range(16)))
    assert KVPolicy(overlap_weight=1.0, temperature=0.0).choose(registry.workers(), overlaps, blocks).worker_id == "b"

