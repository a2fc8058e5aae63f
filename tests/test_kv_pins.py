"""A KV source's pins in one process (no peers): each ends once, answers only to its own id, and
is held open by a block copy under way; and a pull's own failure survives a Release that cannot
be sent."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvtransfer.connector import KVTransferError
from kvtransfer.grpc_backend import GrpcConnector
from kvtransfer.layout import layout_to_proto, read_block
from kvtransfer.source import KVSource
from proto.pdspec.v1 import kv_pb2
from tests.kv_peers import LAYOUT, TOKEN, WAIT_S, random_caches


def test_on_release_runs_once_on_release_or_close():
    calls = []
    source = KVSource(LAYOUT, random_caches(LAYOUT, 4, 0), pin_timeout_s=3600, nixl=False)
    source.pin("a", [0, 1], lambda: calls.append("a"))
    with pytest.raises(ValueError, match="already pinned"):
        source.pin("a", [2], lambda: calls.append("a again"))
    assert source.release("a") and not source.release("a")
    source.pin("b", [2], lambda: calls.append("b"))
    source.close()
    assert not source.release("b")
    assert calls == ["a", "b"]


def test_a_pin_answers_only_to_its_own_id():
    """A router retries a request under its id, maybe on the same prefill worker: the earlier
    attempt's late Release (or pull) must not end (or read) the retry's pin."""
    source = KVSource(LAYOUT, random_caches(LAYOUT, 4, 0), pin_timeout_s=3600, nixl=False)
    earlier = source.pin("r", [0], lambda: None)
    assert source.release("r", earlier)
    retry = source.pin("r", [1], lambda: None)
    assert retry != earlier
    assert not source.release("r", earlier) and source.pinned("r", earlier) is None
    assert source.read_pinned("r", earlier, "target", 1) is None
    assert source.pinned("r", retry) == {1} and source.read_pinned("r", retry, "target", 1) is not None
    assert source.release("r", retry)
    source.close()


@pytest.fixture
def slow_copies(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """The source's block copies wait (a device cache's slow copy, as a fault): (copying: one has
    begun, finish: let them end)."""
    import kvtransfer.source

    copying, finish, read_block = threading.Event(), threading.Event(), kvtransfer.source.read_block

    def slow_copy(cache, block_id):
        copying.set()
        finish.wait(60)
        return read_block(cache, block_id)

    monkeypatch.setattr(kvtransfer.source, "read_block", slow_copy)
    yield copying, finish
    finish.set()


def test_a_block_copy_under_way_holds_its_pin_open_but_not_the_source(slow_copies):
    """A pin ended while PullBlocks copies one of its blocks frees the blocks after the copy, not
    before; meanwhile other pins are made and ended (the copy held the source's lock: every pin and
    Release, the prefill worker's handles with them, waited on a device cache's copy)."""
    copying, finish = slow_copies
    calls = []
    source = KVSource(LAYOUT, random_caches(LAYOUT, 4, 0), pin_timeout_s=3600, nixl=False)
    pin = source.pin("r", [0], lambda: calls.append("r"))
    read = []
    reader = threading.Thread(target=lambda: read.append(source.read_pinned("r", pin, "target", 0)))
    reader.start()
    try:
        assert copying.wait(30)
        others = threading.Thread(target=lambda: (source.pin("s", [1], lambda: calls.append("s")),
                                                  source.release("s"), source.release("r")))
        others.start()
        others.join(30)
        assert not others.is_alive(), "pinning and releasing waited on another pin's block copy"
        assert calls == ["s"]  # r's blocks stay until its copy is done
    finally:
        finish.set()
        reader.join(30)
    assert read[0] == read_block(source.caches["target"], 0) and calls == ["s", "r"]
    source.close()
    assert calls == ["s", "r"]


def test_a_release_that_must_see_the_blocks_freed_waits_for_a_copy_under_way(slow_copies):
    """A prefill worker ends a retried request's stale pin before it prefills the retry: with a
    gRPC pull's block copy from that pin under way, the pin's end (which frees the request's blocks)
    came after the copy, and the retry met its id still in use (ALREADY_EXISTS)."""
    copying, finish = slow_copies
    calls = []
    source = KVSource(LAYOUT, random_caches(LAYOUT, 4, 0), pin_timeout_s=3600, nixl=False)
    pin = source.pin("r", [0], lambda: calls.append("r freed"))
    reader = threading.Thread(target=source.read_pinned, args=("r", pin, "target", 0))
    reader.start()
    assert copying.wait(30)
    releasing = threading.Thread(target=lambda: calls.append(("released", source.release("r", wait_s=30))))
    releasing.start()
    time.sleep(0.3)
    assert calls == []  # the copy still runs: the release waits for it
    finish.set()
    releasing.join(30)
    reader.join(30)
    assert calls == ["r freed", ("released", True)]
    source.close()


class _ClosedUnderTheRead(GrpcConnector):
    def _move(self, stub, handle, remote_block_ids, local_block_ids, deadline, cancel):
        self._close_channels()
        raise KVTransferError("injected: the READ could not be stopped", retryable=True, may_still_write=True)


def pull_cut_by_shutdown(token: str | None) -> str:
    """The failure of a pull whose connector closed its channels under it: "may still write: MESSAGE"."""
    connector = _ClosedUnderTheRead(LAYOUT, random_caches(LAYOUT, 4, 1), token=token)
    handle = kv_pb2.KVHandle(request_id="r", source_worker_id="prefill-test", source_address="127.0.0.1:9",
                             layout=layout_to_proto(LAYOUT), block_ids=[0, 1], pin_id="p")
    try:
        connector.pull(handle, [0, 1], [2, 3], timeout_s=5.0)
    except KVTransferError as e:
        return f"{'may still write' if e.may_still_write else 'freed'}: {e}"
    finally:
        connector.close()
    return "pulled"


@pytest.mark.parametrize("token", [None, TOKEN])
def test_a_pull_cut_by_shutdown_still_says_its_blocks_may_be_written(token):
    """The worker shutting down closes the channels under a pull whose READ it could not stop (a
    fault injected in the move): the pull's own failure, which says the blocks may still be
    written (never to be reused), must reach the caller; the closed channel's error replaced it,
    and the blocks went back to the pool. With a cluster token (NIXL's case, always), the Release
    on the closed channel crashed the process (grpc, through the token's interceptor): now a
    channel in use is closed by its last pull. In a process of its own: a crash fails this test only."""
    code = f"from tests.test_kv_pins import pull_cut_by_shutdown; print(pull_cut_by_shutdown({token!r}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT_S,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith("may still write: injected"), done.stdout


def test_pin_timeout_runs_on_release_once():
    calls, ended = [], threading.Event()
    source = KVSource(LAYOUT, random_caches(LAYOUT, 4, 0), pin_timeout_s=0.05, nixl=False)
    source.pin("a", [0], lambda: (calls.append("a"), ended.set()))
    assert ended.wait(WAIT_S)
    assert not source.release("a")
    source.close()
    assert calls == ["a"]
