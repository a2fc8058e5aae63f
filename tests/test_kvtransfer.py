"""kvtransfer end to end: a KVSource process serving, a destination process pulling (both in
tests/kv_peers.py), over gRPC and over NIXL."""

import dataclasses
import subprocess
import sys
import time

import grpc
import pytest

from engine.kv_layout import CacheShape
from kvtransfer.connector import RELEASE_MIN_TIMEOUT_S
from kvtransfer.layout import layout_from_proto, layout_to_proto
from proto.pdspec.v1 import kv_pb2, kv_pb2_grpc
from tests.kv_peers import (BACKENDS, LAYOUT, LOCAL, REMOTE, TOKEN, WAIT_S, DestinationProcess, SourceProcess,
                            assert_local, random_caches)


@pytest.fixture(scope="module")
def source():
    process = SourceProcess()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def short_pin_source():
    process = SourceProcess(pin_timeout_s=0.2)
    yield process
    process.stop()


@pytest.fixture
def doomed_source():
    """A source with test-only faults, for one test that may kill it."""
    process = SourceProcess(faulty=True)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def destination_process():
    process = DestinationProcess()
    yield process
    process.stop()


@pytest.fixture
def dest(destination_process) -> DestinationProcess:
    """The destination, its caches at their initial contents."""
    destination_process.reset()
    return destination_process


def test_importing_kvtransfer_leaves_nixl_unloaded():
    code = ("import sys, kvtransfer.source, kvtransfer.connector, kvtransfer.grpc_backend; "
            "assert 'nixl_cu12' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("draft", [CacheShape(1, 2, 8), None])
def test_layout_proto_round_trip(draft):
    layout = dataclasses.replace(LAYOUT, draft=draft)
    assert layout_from_proto(layout_to_proto(layout)) == layout


def test_a_handle_without_checksums_is_pulled_with_a_warning(source, caplog):
    """A source whose caches are in device memory hashes no blocks: its pulls go unchecked end to
    end, which the destination says once (it said nothing)."""
    from kvtransfer.grpc_backend import GrpcConnector

    connector = GrpcConnector(LAYOUT, random_caches(LAYOUT, 8, 1), token=TOKEN)
    try:
        for request_id in ("unchecked-1", "unchecked-2"):
            handle = source.pin(request_id)
            del handle.block_checksums[:]
            connector.pull(handle, list(handle.block_ids), list(range(len(handle.block_ids))), timeout_s=WAIT_S)
    finally:
        connector.close()
    said = [r for r in caplog.records if "came without checksums" in r.getMessage()]
    assert len(said) == 1 and source.address in said[0].getMessage()


@pytest.mark.parametrize("backend", BACKENDS)
def test_pull_copies_exactly_the_requested_blocks(backend, source, dest):
    handle = source.pin(f"pull-{backend}")
    assert dest.pull(backend, handle) is None
    assert_local(dest, dict(zip(LOCAL, REMOTE)))
    source.wait_released(handle.request_id)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pull_of_no_blocks_still_releases(backend, source, dest):
    handle = source.pin(f"cached-{backend}")
    assert dest.pull(backend, handle, [], []) is None
    assert_local(dest, {})
    source.wait_released(handle.request_id)


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_token_is_unauthenticated(backend, source, dest):
    error = dest.pull_error(backend, source.pin(f"token-{backend}"), token="wrong-token")
    assert "UNAUTHENTICATED" in str(error) and not error.retryable
    assert_local(dest, {})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("field, value", [("block_size", 8), ("dtype", "float32"), ("dtype", "int8"),
                                          ("draft_model", "other-head@2")])
def test_layout_mismatch_names_the_field_and_moves_nothing(backend, source, dest, field, value):
    """A KV cache dtype (engine.kv_cache_dtype), block size or EAGLE3 head differing between the
    sides: refused, naming the field and both values."""
    other = dataclasses.replace(LAYOUT, **{field: value})
    honest = source.pin(f"layout-{backend}-{field}")  # caught here, from the handle
    forged = source.pin(f"forged-layout-{backend}-{field}")  # the handle claims our layout: the source must catch it
    forged.layout.CopyFrom(layout_to_proto(other))
    for handle in (honest, forged):
        error = dest.pull_error(backend, handle, layout=other)
        assert f"'{field}'" in str(error) and str(value) in str(error) and str(getattr(LAYOUT, field)) in str(error)
        assert not error.retryable
        source.wait_released(handle.request_id)
    assert_local(dest, {}, layout=other)


def test_source_refuses_blocks_outside_the_pin(source, dest):
    handle = source.pin("foreign-blocks")
    handle.block_ids.append(3)  # not pinned for this request
    error = dest.pull_error("grpc", handle, [3], [0])
    assert "PERMISSION_DENIED" in str(error) and not error.retryable
    assert_local(dest, {})


@pytest.mark.parametrize("backend,reason", [("grpc", "NOT_FOUND"), ("nixl", "no longer pinned")])
def test_pin_timeout_releases_and_later_pull_fails(backend, reason, short_pin_source, dest):
    handle = short_pin_source.pin(f"expired-{backend}")
    short_pin_source.wait_released(handle.request_id)  # the reaper ran on_release
    error = dest.pull_error(backend, handle)
    assert reason in str(error) and error.retryable
    assert_local(dest, {}, undefined=LOCAL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pin_that_lapsed_by_the_release_fails_only_a_nixl_pull(backend, doomed_source, dest):
    """A one-sided READ's bytes are the pin's only if it held until the Release; the gRPC source
    read every block under its pin, so its pull stands."""
    handle = doomed_source.pin(f"lapsed-{backend}")
    error = dest.pull(backend, handle)
    if backend == "grpc":
        assert error is None
        assert_local(dest, dict(zip(LOCAL, REMOTE)))
    else:
        assert error is not None and "no longer pinned" in str(error) and error.retryable


def test_corrupted_chunk_fails_its_checksum(doomed_source, dest):
    error = dest.pull_error("grpc", doomed_source.pin("corrupt"))
    assert "checksum" in str(error) and error.retryable
    assert_local(dest, {}, undefined=LOCAL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_blocks_changed_under_their_pin_fail_the_handles_checksums(backend, doomed_source, dest):
    """A NIXL READ has no checksum of its own, and gRPC checksums each chunk as it is sent: only
    the handle's checksums, taken when the blocks were pinned, see a block that changed (or was
    corrupted) between the pin and the read."""
    error = dest.pull_error(backend, doomed_source.pin("changed"))
    assert "does not match the checksums of its pinned blocks" in str(error) and error.retryable


def test_source_killed_mid_stream_is_retryable(doomed_source, dest):
    dest.start_pull("grpc", doomed_source.pin("stall"))
    doomed_source.expect("streaming")
    doomed_source.kill()
    error = dest.result()
    assert error is not None and error.retryable
    assert_local(dest, {}, undefined=LOCAL)


def test_source_killed_before_nixl_read_is_retryable(doomed_source, dest):
    # After this pull the destination holds the source's NIXL metadata: the next READ goes straight to it.
    assert dest.pull("nixl", doomed_source.pin("warm")) is None
    handle = doomed_source.pin("doomed")
    doomed_source.kill()
    error = dest.pull_error("nixl", handle, [9, 5], [1, 3])
    assert error.retryable and not error.may_still_write
    assert_local(dest, dict(zip(LOCAL, REMOTE)), undefined=[1, 3])


def test_a_nixl_read_that_cannot_be_cancelled_says_its_blocks_may_still_be_written(source, dest):
    """Its caller must then never reuse the local blocks (the decode worker retires them)."""
    handle = source.pin("unstoppable")
    error = dest.pull_error("nixl", handle, fault="unstoppable")
    assert error.may_still_write and error.retryable, error
    assert "refused to release it" in str(error) and "injected: the READ stalled" in str(error)
    source.wait_released(handle.request_id)  # the pin still went back


def test_an_agent_nixl_refuses_to_drop_is_not_asked_again_at_every_pull(doomed_source, source, dest):
    """A READ from a source that died forgets its agent; NIXL refusing to drop it left it to the
    idle sweep, which asked again (and warned) as every later pull started: now once it has been
    idle SOURCE_IDLE_S more."""
    assert dest.pull("nixl", doomed_source.pin("warm")) is None  # its agent loaded
    handle = doomed_source.pin("doomed")
    doomed_source.kill()
    refused = dest.refused_removals()
    assert dest.pull_error("nixl", handle, fault="refused-removal").retryable
    assert dest.refused_removals() == refused + 1
    for i in range(3):
        assert dest.pull("nixl", source.pin(f"later-{i}"), fault="refused-removal") is None
    assert dest.refused_removals() == refused + 1


def test_a_closing_connector_keeps_the_memory_an_uncancelled_read_may_write(source):
    """The READ's pull ended long before (its blocks retired): closing the connector must still not
    deregister the memory that READ may write into (undefined behaviour in UCX)."""
    dest = DestinationProcess()  # of its own: it ends with its caches registered for good
    try:
        assert dest.pull("nixl", source.pin("before-close")) is None
        dest.close()
        assert dest.wait_closed() == [False]  # deregistered: no READ left that may write
        handle = source.pin("unstoppable-then-close")
        assert dest.pull_error("nixl", handle, fault="unstoppable").may_still_write
        dest.close()
        assert dest.wait_closed() == [True]
    finally:
        dest.stop()
    source.wait_released(handle.request_id)


# Blocks of 16 MB: a READ of three takes a while, even over loopback.
LARGE = dataclasses.replace(LAYOUT, block_size=64, target=CacheShape(32, 16, 128))


def test_a_cancelled_nixl_read_writes_nothing_after_its_pull_ends(monkeypatch):
    """UCX cannot cancel a READ under way: releasing it only detaches it. Over TCP (as between
    hosts) a pull cancelled just after posting its READ reported itself ended while the READ went
    on writing into local blocks the decode worker had freed for other requests. It now waits for
    the READ's end (or gives its blocks up for good)."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # inherited by both processes: READs under way, not done at once
    source, dest = SourceProcess(layout=LARGE), DestinationProcess()
    try:
        assert dest.pull("nixl", source.pin("warm"), layout=LARGE) is None  # its agent loaded
        dest.reset()
        error, posted, changed = dest.late_writes(source.pin("cancelled"), LARGE)
        assert posted == "PROC"  # else nothing here was under way when the pull was cancelled
        assert error is not None and "cancelled" in str(error) and error.retryable, error
        assert error.may_still_write or not changed
    finally:
        dest.stop()
        source.stop()

@pytest.mark.parametrize("stop", ["cancel", "close"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pull_stops_when_cancelled_or_its_connector_closes(backend, stop, doomed_source, dest):
    """A cancelled request's pull (its client gone) or one under a closing worker ends, its pin
    released: it ran on for its timeout, holding a source pull slot, the pin and its blocks, and a
    closing NIXL connector deregistered memory a READ still wrote into. Its Release to a source
    that stalls as well waits RELEASE_MIN_TIMEOUT_S at most, not the rest of the pull's time. (A
    NIXL READ cannot be cancelled: this one never ends, so after READ_DRAIN_S its blocks are given
    up for good.)"""
    handle = doomed_source.pin("stall")
    if backend == "grpc":
        dest.start_pull("grpc", handle)  # the source sends one chunk, then stalls for good
        doomed_source.expect("streaming")
    else:
        assert dest.pull("nixl", doomed_source.pin("warm")) is None  # its agent loaded: the next pull READs at once
        dest.start_pull("nixl", handle, fault="stuck")
        time.sleep(0.5)  # well into its READ (the NIXL poll sees the cancel; before it, so does the check after)
    dest.cancel() if stop == "cancel" else dest.close()
    error = dest.result()
    assert error is not None and "cancelled" in str(error) and error.retryable, error
    assert error.may_still_write == (backend == "nixl")
    if stop == "close":
        dest.wait_closed()
    assert doomed_source.expect("release-timeout") < RELEASE_MIN_TIMEOUT_S + 1  # as gRPC carries it (rounded up)
    doomed_source.wait_released(handle.request_id)
    dest.reset()
    assert dest.pull(backend, doomed_source.pin("after")) is None  # new connectors, or the same one: it pulls
    assert_local(dest, dict(zip(LOCAL, REMOTE)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_release_under_way_when_its_pull_is_cancelled_still_lands(backend, doomed_source, dest):
    """The bytes moved and the Release is on its way when the pull is cancelled (its client gone,
    the worker closing): the Release was cut off at once, and the source kept the pin until it
    timed out. It gets RELEASE_MIN_TIMEOUT_S still."""
    handle = doomed_source.pin("queued-release")
    dest.start_pull(backend, handle)
    assert doomed_source.expect("release-sent") == handle.request_id
    dest.cancel()
    dest.result()  # done or cancelled: the pin is what matters here
    assert doomed_source.expect("released") == handle.request_id


def test_pulls_held_up_by_a_source_stalling_its_nixl_metadata_stop_when_cancelled(doomed_source, dest):
    """A source's agent is loaded under its address's lock: a source that stalled its metadata held
    the pull fetching it, and every other pull from it waiting on the lock, until their deadlines,
    cancelled or not (and a closing worker with them)."""
    first, second = doomed_source.pin("hang-metadata-1"), doomed_source.pin("hang-metadata-2")
    dest.start_pull("nixl", first)
    doomed_source.expect("metadata-asked")
    dest.start_pull("nixl", second)  # waits for the address's lock
    dest.cancel()  # the second pull's
    error = dest.result()
    assert error is not None and "cancelled while another pull fetched the NIXL metadata" in str(error), error
    dest.close()  # cancels the first
    error = dest.result()
    assert error is not None and "cancelled while it fetched the NIXL metadata" in str(error) and error.retryable
    dest.wait_closed()
    for handle in (first, second):
        doomed_source.wait_released(handle.request_id)


def test_a_handle_of_another_nixl_agent_at_the_address_is_a_restarted_source(source, dest):
    """The handle names the source's agent: a process restarted at the same address (its pins
    gone with the old one) is told apart at once, not by a READ of the old agent timing out."""
    assert dest.pull("nixl", source.pin("before-restart")) is None  # the source's agent is loaded
    handle = source.pin("restarted")
    handle.nixl_agent = "pdspec-kvsource-000000000000"  # the agent that prefilled it: gone
    error = dest.pull_error("nixl", handle)
    assert "restarted after prefilling" in str(error) and error.retryable
    source.wait_released(handle.request_id)
    dest.reset()
    assert dest.pull("nixl", source.pin("after-restart")) is None  # the current agent, loaded again
    assert_local(dest, dict(zip(LOCAL, REMOTE)))


def test_nixl_metadata_the_handle_does_not_vouch_for_is_never_loaded(source, dest):
    """NIXL's agent metadata is a pickle: a destination loads it only if it hashes to the digest the
    prefill worker put in the handle, whoever answers at the source's address (without TLS, a pod
    that took over a gone worker's address answers there)."""
    handle = source.pin("unvouched")
    handle.nixl_metadata_sha256 = bytes(32)  # as if another process answered at the address
    error = dest.pull_error("nixl", handle)
    assert "not loaded" in str(error) and error.retryable, error
    source.wait_released(handle.request_id)
    handle = source.pin("undigested")
    handle.ClearField("nixl_metadata_sha256")  # a handle that vouches for nothing
    assert "digest" in str(dest.pull_error("nixl", handle))
    source.wait_released(handle.request_id)
    assert dest.pull("nixl", source.pin("vouched")) is None


def test_a_source_serves_its_most_pulls_at_once_and_the_others_wait_their_turn(dest):
    """Each PullBlocks stream holds a server thread: past the source's max_pulls one is refused at
    once (RESOURCE_EXHAUSTED), and the puller waits its turn instead of blaming the source."""
    from proto.rpc import channel

    busy = SourceProcess(nixl=False, faulty=True, max_pulls=1)
    try:
        handles = [busy.pin(f"slow-{i}") for i in range(2)]
        assert dest.pull_together("grpc", [(h, REMOTE[:1], [i]) for i, h in enumerate(handles)]) == [None, None]
        dest.start_pull("grpc", busy.pin("stall"))
        busy.expect("streaming")
        with channel(busy.address, TOKEN) as ch:
            other = busy.pin("refused")
            request = kv_pb2.PullBlocksRequest(request_id="refused", block_ids=REMOTE, pin_id=other.pin_id,
                                               expected_layout=layout_to_proto(LAYOUT))
            with pytest.raises(grpc.RpcError) as refused:
                list(kv_pb2_grpc.KVTransferStub(ch).PullBlocks(request, timeout=10))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "serves 1 KV pull calls already; wait for one to end" in refused.value.details()
    finally:
        busy.kill()
    assert dest.result() is not None  # the stalled pull, cut with its source


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_pulls_from_one_source_all_land(backend, source, dest):
    """Several handler threads pull from one prefill worker at once (a decode worker's usual
    load): each READ goes through the one loaded agent, none drops it under another."""
    handles = [source.pin(f"together-{backend}-{i}", [2 + i]) for i in range(4)]
    assert dest.pull_together(backend, [(h, [2 + i], [i]) for i, h in enumerate(handles)]) == [None] * 4
    assert_local(dest, {i: 2 + i for i in range(4)})
    for h in handles:
        source.wait_released(h.request_id)


def test_nixl_needs_a_cluster_token():
    code = ("import torch; from kvtransfer.source import KVSource; from tests.test_kvtransfer import LAYOUT, random_caches\n"
            "try:\n    KVSource(LAYOUT, random_caches(LAYOUT, 4, 0), pin_timeout_s=60, nixl=True)\n"
            "except ValueError as e:\n    assert 'cluster token' in str(e), e\nelse:\n    raise SystemExit('started')")
    subprocess.run([sys.executable, "-c", code], check=True)
