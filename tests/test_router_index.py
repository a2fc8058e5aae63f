"""The router's KV index and registry, fed with the KV events of real BlockManagers."""

from functools import partial

import grpc
import pytest

from engine.block_manager import BlockManager
from engine.hashing import hash_blocks
from serving.convert import kv_event
from proto.pdspec.v1 import kv_pb2, worker_pb2
from router.kv_index import KVIndex
from router.registry import RegistrationError, Registry

BS = 4
LAYOUT = kv_pb2.KVLayout(model="m", dtype="float32", block_size=BS,
                         target=kv_pb2.CacheShape(num_layers=2, num_kv_heads=1, head_dim=8))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CacheWorker:
    """A worker's prefix cache: a real BlockManager whose events go out in heartbeats."""

    def __init__(self, worker_id: str, num_blocks: int = 16) -> None:
        self.worker_id = worker_id
        self.blocks = BlockManager(num_blocks, BS)
        self.events = []
        self.blocks.subscribe(self.events.append)

    def run(self, seq_id: str, prompt: list[int]) -> None:
        """Prefill `prompt`; the sequence keeps its blocks until `finish`."""
        cached = self.blocks.allocate(seq_id, prompt)
        self.blocks.commit(seq_id, prompt[cached:])

    def finish(self, seq_id: str) -> None:
        self.blocks.free(seq_id)

    def registration(self) -> worker_pb2.RegisterRequest:
        return worker_pb2.RegisterRequest(worker_id=self.worker_id, role="prefill", address=f"{self.worker_id}:1",
                                          layout=LAYOUT, total_blocks=self.blocks.num_blocks, max_model_len=64,
                                          max_num_seqs=4)

    def heartbeat(self) -> worker_pb2.HeartbeatRequest:
        events = [kv_event(e) for e in self.events]
        self.events.clear()  # in place: the BlockManager appends to this very list
        return worker_pb2.HeartbeatRequest(worker_id=self.worker_id, events=events,
                                           load=worker_pb2.Load(active_blocks=self.blocks.num_used_blocks))


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def continued(prompt: list[int]) -> list[int]:
    """A later prompt that goes on from `prompt`: each of `prompt`'s full blocks is reusable (a
    prompt's last token is computed, cached or not)."""
    return prompt + [10_000]


@pytest.fixture
def cluster():
    clock = Clock()
    registry = Registry(clock)
    workers = {wid: CacheWorker(wid) for wid in ("a", "b")}
    for w in workers.values():
        registry.register(w.registration())
    return registry, workers, clock


def serve(registry: Registry, worker: CacheWorker, seq_id: str, prompt: list[int]) -> None:
    worker.run(seq_id, prompt)
    worker.finish(seq_id)
    assert registry.heartbeat(worker.heartbeat())


def test_overlap_is_the_leading_cached_blocks(cluster):
    registry, w, _ = cluster
    prompt = tokens(0, 3 * BS + 2)  # 3 full blocks and a partial one (never cached)
    serve(registry, w["a"], "s1", prompt)
    serve(registry, w["b"], "s2", prompt[:BS] + tokens(1000, 2 * BS))
    assert registry.prefix_overlaps(prompt) == ({"a": 3, "b": 1}, 4)
    assert registry.prefix_overlaps(tokens(500, 2 * BS)) == ({}, 2)
    assert {v.worker_id: v.cached_blocks for v in registry.workers()} == {"a": 3, "b": 3}


@pytest.mark.parametrize("length", [2 * BS, 2 * BS + 1, 3 * BS - 1, 3 * BS])
def test_overlap_is_what_the_worker_would_reuse(cluster, length):
    """A prompt of whole blocks reuses all but its last one (its last token is computed for its
    logits): counted as cached, routing overrated the worker holding it by a block."""
    registry, w, _ = cluster
    serve(registry, w["a"], "s1", tokens(0, 3 * BS))
    prompt = tokens(0, length)
    assert registry.prefix_overlaps(prompt)[0] == {"a": w["a"].blocks.get_num_cached_tokens(prompt) // BS}


def test_a_missing_block_ends_the_run():
    index = KVIndex()
    chain = hash_blocks(tokens(0, 4 * BS), BS)
    index.store("a", [chain[0], chain[1], chain[3]])
    index.store("b", chain)
    assert index.overlaps(chain) == {"a": 2, "b": 4}


def test_evicted_blocks_leave_the_index(cluster):
    registry, w, _ = cluster
    small = CacheWorker("c", num_blocks=4)
    registry.register(small.registration())
    first, second = tokens(0, 3 * BS), tokens(100, 4 * BS)
    serve(registry, small, "s1", first)
    assert registry.prefix_overlaps(continued(first))[0] == {"c": 3}
    serve(registry, small, "s2", second)  # needs the whole pool: evicts the first prompt's blocks
    assert registry.prefix_overlaps(continued(first))[0] == {}
    assert registry.prefix_overlaps(continued(second))[0] == {"c": 4}


def test_all_blocks_cleared_resets_only_that_worker(cluster):
    registry, w, _ = cluster
    done, running = tokens(0, 2 * BS), tokens(200, 2 * BS)
    serve(registry, w["a"], "s1", done)
    serve(registry, w["b"], "s1", done)
    w["a"].run("s2", running)
    w["a"].blocks.clear_prefix_cache()  # AllBlocksCleared, then BlockStored for blocks still in use
    assert registry.heartbeat(w["a"].heartbeat())
    assert registry.prefix_overlaps(continued(done))[0] == {"b": 2}
    assert registry.prefix_overlaps(continued(running))[0] == {"a": 2}


def test_silent_workers_are_evicted_with_their_entries(cluster):
    registry, w, clock = cluster
    prompt = tokens(0, 2 * BS)
    serve(registry, w["a"], "s1", prompt)
    serve(registry, w["b"], "s1", prompt)
    clock.now = 2.0
    assert registry.heartbeat(w["a"].heartbeat())
    clock.now = 3.5
    assert registry.evict_stale(timeout_s=3.0) == ["b"]
    assert [v.worker_id for v in registry.workers()] == ["a"]
    assert registry.prefix_overlaps(continued(prompt))[0] == {"a": 2}
    assert not registry.heartbeat(w["b"].heartbeat())  # b must register again


def test_registration_snapshot_replaces_what_the_index_knew(cluster):
    registry, w, _ = cluster
    prompt = tokens(0, 2 * BS)
    serve(registry, w["a"], "s1", prompt)
    restarted = w["a"].registration()
    registry.register(restarted)  # empty snapshot: the restarted worker's cache is empty
    assert registry.prefix_overlaps(continued(prompt))[0] == {}
    restarted.cached_block_hashes.extend(hash_blocks(prompt, BS))
    registry.register(restarted)
    assert registry.prefix_overlaps(continued(prompt))[0] == {"a": 2}


def _load_of_a(registry: Registry) -> tuple[int, int]:
    view = {v.worker_id: v for v in registry.workers()}["a"]
    return view.running, view.active_blocks


def _heartbeat_of_a(registry: Registry, running: int, blocks: int, arrived: list[str]) -> None:
    registry.heartbeat(worker_pb2.HeartbeatRequest(worker_id="a", arrived_request_ids=arrived,
                                                   load=worker_pb2.Load(active_blocks=blocks, running=running)))


def test_a_routed_request_counts_once_until_its_workers_heartbeat_names_it(cluster):
    """The router counts a request it routed until the worker's load does: a heartbeat sent before
    the worker had the request (a long prompt's prefill elsewhere takes seconds) does not count it,
    one after it does, and names it; counted by both, it made its worker look busier than it was."""
    registry, w, _ = cluster
    load, heartbeat = partial(_load_of_a, registry), partial(_heartbeat_of_a, registry)
    registry.note_routed(["a", "b"], "r1", 5)
    assert load() == (1, 5)
    heartbeat(0, 0, [])  # before r1 reached it
    assert load() == (1, 5)
    heartbeat(1, 5, ["r1"])  # its load counts r1 now
    assert load() == (1, 5)
    heartbeat(1, 6, [])
    assert load() == (1, 6)
    registry.note_routed(["a"], "r2", 3)
    registry.forget_routed(["a"], "r2")  # its attempt failed before it reached the worker
    heartbeat(1, 6, ["r2"])  # a late report of a request the attempt gave up on: nothing to drop
    assert load() == (1, 6)
    registry.forget_routed(["gone"], "r1")  # a worker evicted meanwhile

    def running_on_b() -> int:  # b's heartbeats have not named r1
        return {v.worker_id: v.running for v in registry.workers()}["b"]

    assert running_on_b() == 1
    registry.register(w["b"].registration())  # registered again (after a lost heartbeat): r1 still counts
    assert running_on_b() == 1
    registry.forget_routed(["a", "b"], "r1")  # it ended, never named by b (a worker of an older version)
    assert running_on_b() == 0


def test_a_failed_attempts_late_arrival_leaves_its_retry_counted(cluster):
    """A prefill that ran on a worker whose heartbeats had not named it yet, and whose decode then
    failed: the worker names it late, maybe after the retry was routed to it under the same id. That
    naming is the failed attempt's; the retry stays counted until its own arrival is named."""
    registry, _, _ = cluster
    load, heartbeat = partial(_load_of_a, registry), partial(_heartbeat_of_a, registry)
    registry.note_routed(["a", "b"], "r1", 5)
    registry.forget_routed(["a", "b"], "r1", reached=["a"])  # the decode side failed
    registry.note_routed(["a", "b"], "r1", 5)  # the retry, to the same prefill worker
    heartbeat(0, 0, ["r1"])  # the first attempt's arrival (its blocks freed since)
    assert load() == (1, 5)
    heartbeat(1, 5, ["r1"])  # the retry's
    assert load() == (1, 5)
    heartbeat(0, 0, [])  # it ended there: no longer counted
    assert load() == (0, 0)
    registry.forget_routed(["a", "b"], "r1")  # it ended
    # Both arrivals in one heartbeat: named twice.
    registry.note_routed(["a", "b"], "r2", 4)
    registry.forget_routed(["a", "b"], "r2", reached=["a"])
    registry.note_routed(["a", "b"], "r2", 4)
    heartbeat(1, 4, ["r2", "r2"])
    heartbeat(1, 4, [])
    assert load() == (1, 4)
    # A late naming that never comes (the worker died and restarted) expires after two heartbeats.
    registry.forget_routed(["a", "b"], "r2")
    registry.note_routed(["a", "b"], "r3", 2)
    registry.forget_routed(["a", "b"], "r3", reached=["a"])
    heartbeat(0, 0, [])
    heartbeat(0, 0, [])
    registry.note_routed(["a", "b"], "r3", 2)
    heartbeat(1, 2, ["r3"])
    assert load() == (1, 2)


@pytest.mark.parametrize("change, code, field", [
    ({"role": "both"}, grpc.StatusCode.INVALID_ARGUMENT, "role"),
    ({"total_blocks": 0}, grpc.StatusCode.INVALID_ARGUMENT, "total_blocks"),
    ({"worker_id": ""}, grpc.StatusCode.INVALID_ARGUMENT, "worker_id"),
    ({"layout": kv_pb2.KVLayout(model="m", dtype="float32", block_size=8, target=LAYOUT.target)},
     grpc.StatusCode.FAILED_PRECONDITION, "layout.block_size"),
    ({"layout": kv_pb2.KVLayout(model="other", dtype="float32", block_size=BS, target=LAYOUT.target)},
     grpc.StatusCode.FAILED_PRECONDITION, "layout.model"),
])
def test_bad_registrations_are_rejected_naming_the_field(cluster, change, code, field):
    registry, _, _ = cluster
    request = CacheWorker("new").registration()
    for name, value in change.items():
        if isinstance(value, kv_pb2.KVLayout):
            getattr(request, name).CopyFrom(value)
        else:
            setattr(request, name, value)
    with pytest.raises(RegistrationError) as e:
        registry.register(request)
    assert e.value.code == code and str(e.value).startswith(f"{field}:"), str(e.value)


def test_capacity_is_what_the_decode_side_runs():
    """A disaggregated request holds a decode slot for its whole answer and a prefill slot
    briefly: prefill workers' batches are no capacity (admitting them let twice the decode
    workers' batches through, to wait at the decode workers with their prefill pinned)."""
    registry = Registry()

    def add(worker_id: str, role: str, max_num_seqs: int) -> None:
        registry.register(worker_pb2.RegisterRequest(worker_id=worker_id, role=role, address=f"{worker_id}:1",
                                                     layout=LAYOUT, total_blocks=100, max_model_len=64,
                                                     max_num_seqs=max_num_seqs))

    add("p", "prefill", 64)
    assert registry.capacity() == 0  # no route yet: requests pass through to routing's UNAVAILABLE
    add("d", "decode", 16)
    assert registry.capacity() == 16
    add("agg", "aggregated", 8)
    assert registry.capacity() == 16  # the pair is the route while it exists
    registry.evict("p", "p:1")
    assert registry.capacity() == 8


def test_a_late_heartbeat_of_an_earlier_registration_changes_nothing(cluster):
    """A worker whose heartbeat timed out registers again with a snapshot; should the router get
    that heartbeat late, its events predate the snapshot and must not apply (and a late, older
    Register is caught by the next heartbeat, which the worker answers by registering again)."""
    registry, w, _ = cluster
    worker, prompt = w["a"], tokens(0, 8)
    first = worker.registration()
    first.registration_id = "r1"
    registry.register(first)
    worker.run("s", prompt)
    late = worker.heartbeat()
    late.registration_id = "r1"  # stored blocks, sent before the worker re-registered
    worker.finish("s")
    worker.blocks.clear_prefix_cache()
    worker.heartbeat()  # lost: the re-registration's snapshot covers it
    second = worker.registration()
    second.registration_id = "r2"  # an empty cache
    registry.register(second)
    assert not registry.heartbeat(late) and registry.prefix_overlaps(continued(prompt))[0] == {}
    current = worker.heartbeat()
    current.registration_id = "r2"
    assert registry.heartbeat(current)
    registry.register(first)  # the earlier Register, arriving last
    assert not registry.heartbeat(current)  # the worker registers again


def test_a_stopping_process_deregisters_itself_not_its_successor(cluster):
    """A worker restarted at the same address (a fixed port) registered again before its
    predecessor's Deregister (or a failed call's health probe, which names the registration
    routing saw) landed: the new registration stays routed."""
    registry, w, _ = cluster
    old, new = w["a"].registration(), w["a"].registration()
    old.registration_id, new.registration_id = "r1", "r2"
    registry.register(old)
    assert [v.registration_id for v in registry.workers() if v.worker_id == "a"] == ["r1"]
    registry.register(new)
    assert not registry.evict("a", "a:1", "r1") and "a" in {v.worker_id for v in registry.workers()}
    assert registry.evict("a", "a:1", "r2") and "a" not in {v.worker_id for v in registry.workers()}
