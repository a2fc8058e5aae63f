"""A decode engine's hand-offs (KV arriving into reserved blocks, take-overs) and the EngineLoop
thread that serves an engine: its heartbeat bookkeeping, waiting, stopping and trouble reports."""

import threading
import time

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.inference import inference
from engine.loop import EngineLoop
from engine.output import KVHandle, RequestOutput
from engine.params import SamplingParams
from tests.waiting import wait_until


def test_an_incoming_request_aborted_mid_transfer_keeps_its_blocks_until_the_transfer_ends(engine, prompts):
    """A decode worker's handler thread writes a prefilled prompt's KV into its reserved blocks;
    an abort meanwhile (the client left) must not free them under the transfer, where the next
    step could hand them to another request."""
    params = SamplingParams(max_tokens=8)
    free_before = engine.blocks.num_free_blocks
    _, table = engine.reserve_prefilled("moving", prompts[0], params)
    reserved = engine.blocks.num_free_blocks
    assert reserved < free_before
    out = engine.abort("moving")
    assert out.finished and out.finish_reason == "abort"
    assert engine.blocks.num_free_blocks == reserved  # still the transfer's
    handle = KVHandle(table, 0, 0, None, 0, 0.0)
    admitted = engine.admit_prefilled("moving", handle)  # the transfer ended: now they go
    assert admitted.finished and admitted.finish_reason == "abort"
    assert engine.blocks.num_free_blocks == free_before and not engine.has_unfinished()

    engine.reserve_prefilled("failed", prompts[0], params)
    engine.drop_incoming("failed")  # a failed transfer frees them at once
    assert engine.blocks.num_free_blocks == free_before



def test_a_request_whose_kv_is_arriving_holds_its_place_in_the_batch(prompts):
    """A decode worker serves prompts of its own beside hand-offs: a prompt admitted while a
    hand-off's KV arrives must leave it its place, or the batch outgrows max_num_seqs when it is
    in (and with a token budget of max_num_seqs, its youngest sequence decoded nothing)."""
    engine = Engine(EngineConfig(num_kv_blocks=64, max_num_seqs=2))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    _, table = engine.take_over("arriving", prompts[0], params)
    engine.add_request(prompts[1], params, "local-1")
    engine.add_request(prompts[2], params, "local-2")
    engine.step()
    assert [s.seq_id for s in engine.scheduler.running] == ["local-1"]
    engine.admit_prefilled("arriving", KVHandle(table, 0, 0, None, 0, 0.0))
    assert len(engine.scheduler.running) == 2 and [s.seq_id for s in engine.scheduler.waiting] == ["local-2"]
    while engine.has_unfinished():
        engine.step()

def test_a_prefilled_request_is_taken_over_only_with_a_slot_free_and_nobody_waiting(prompts):
    """A sequence waiting to come back (preempted on a decode worker) goes first: new arrivals
    would take every block it frees. The check and the reservation are one step on the loop."""
    engine = Engine(EngineConfig(num_kv_blocks=64, max_num_seqs=2))
    params = SamplingParams(max_tokens=8)
    engine.add_request(prompts[0], params, "waiting")
    assert engine.take_over("new", prompts[1], params) is None and not engine.incoming
    engine.step()  # "waiting" runs now
    cached, table = engine.take_over("new", prompts[1], params)  # the chat template's first block is cached
    assert engine.incoming.keys() == {"new"} and len(table) == -(-len(prompts[1]) // 16) and cached == 16
    assert engine.take_over("third", prompts[2], params) is None  # the batch is full: 1 running + 1 arriving


def test_the_loop_names_each_request_it_took_once_for_the_next_heartbeat(prompts):
    """From a heartbeat naming a request on, the router leaves counting it to the worker's load
    (router/registry.py): every request added or taken over is named once; one refused for want
    of room, never (it is not here)."""
    loop = EngineLoop(Engine(EngineConfig(num_kv_blocks=64, max_num_seqs=2)))
    params = SamplingParams(max_tokens=8)
    try:
        loop.submit("added", prompts[0], SamplingParams(max_tokens=512, ignore_eos=True))  # runs throughout
        deadline = time.monotonic() + 60
        while loop.take_over("taken", prompts[1], params) is None and time.monotonic() < deadline:
            loop.wait_step(0.2)  # until "added" runs (nobody waiting)
        assert loop.take_over("refused", prompts[2], params) is None  # the batch is full
        assert loop.drain_arrivals() == ["added", "taken"]
        assert loop.drain_arrivals() == []
    finally:
        loop.stop()


def test_an_attempt_gives_up_on_its_own_request_not_a_later_one_of_its_id(prompts):
    """A caller whose attempt was aborted (its client gone) and whose id then came back aborts
    nothing of the new attempt's when it gives up late."""
    loop = EngineLoop(Engine(EngineConfig(num_kv_blocks=64)))
    params = SamplingParams(max_tokens=512, ignore_eos=True)
    try:
        first = loop.submit("r", prompts[0], params)
        assert loop.abort("r") and _last(first).finish_reason == "abort"
        second = loop.submit("r", prompts[0], params)
        assert not loop.abort_attempt("r", first)
        assert loop.call(lambda: "r" in loop.engine.seqs)
        assert loop.abort_attempt("r", second) and _last(second).finish_reason == "abort"
    finally:
        loop.stop()


def _last(outputs) -> RequestOutput:
    while not (out := outputs.get(timeout=60)).finished:
        pass
    return out


def test_an_incoming_request_whose_transfer_could_not_be_stopped_never_frees_its_blocks(prompts):
    """A NIXL READ that failed and could not be cancelled may still write into its blocks."""
    engine = Engine(EngineConfig(num_kv_blocks=64))  # its own pool: this one loses blocks for good
    params = SamplingParams(max_tokens=8)
    engine.reserve_prefilled("unstoppable", prompts[0], params)
    reserved = engine.blocks.num_free_blocks
    engine.retire_incoming("unstoppable")
    assert engine.blocks.num_free_blocks == reserved < 64 and not engine.has_unfinished()
    engine.reserve_prefilled("unstoppable", prompts[0], params)  # its id is free again
    engine.drop_incoming("unstoppable")
    assert engine.blocks.num_free_blocks == reserved


@pytest.mark.parametrize("prefill_only", [False, True])
def test_a_failed_step_ends_every_stream_even_those_it_finished(engine, prompts, monkeypatch, prefill_only):
    """Outputs of requests that finished inside a failing step are lost with it: their handlers
    must still get an end, not wait forever; and a request it handed off, whose handle reached
    nobody, must not keep its pinned blocks forever."""
    free_before = engine.blocks.num_free_blocks
    step = engine.step

    def finish_then_fail():
        step()
        raise RuntimeError("injected fault after the step finished its requests")

    monkeypatch.setattr(engine, "step", finish_then_fail)
    loop = EngineLoop(engine)
    try:
        outputs = loop.submit("lost", prompts[0], SamplingParams(max_tokens=1), prefill_only=prefill_only)
        out = outputs.get(timeout=60)
        assert out.finished and out.finish_reason == "error"
    finally:
        loop.stop()
    assert not engine.has_unfinished() and "lost" not in loop.outputs and "lost" not in engine.handed_off
    assert engine.blocks.num_free_blocks == free_before


def test_a_hand_off_whose_draft_release_fails_frees_its_blocks(engine, prompts, monkeypatch):
    """Failing between leaving the batch and being handed off, a prefill-only request's blocks
    were held by neither: the abort that ends it (the loop's, after the failed step) freed none."""
    free_before, counted = engine.blocks.num_free_blocks, dict(engine.counters)
    rid = engine.add_request(prompts[0], SamplingParams(max_tokens=1), prefill_only=True)

    def failing_release(seq):
        raise RuntimeError("injected: the draft cache write failed")

    monkeypatch.setattr(engine.proposer, "release", failing_release)
    with pytest.raises(RuntimeError, match="injected"):
        while True:
            engine.step()
    with pytest.raises(RuntimeError, match="injected"):
        engine.abort(rid, reason="error")
    assert rid not in engine.seqs and rid not in engine.handed_off and not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == free_before
    ended = {k: engine.counters[k] - counted.get(k, 0) for k in ("finished_prefilled", "finished_error")}
    assert ended == {"finished_prefilled": 0, "finished_error": 1}  # once, as the error it was


def test_the_loop_waits_for_a_command_while_no_sequence_can_run(monkeypatch):
    """A prefill worker's pool held by handed-off KV (pinned until the decode side reads it): the
    request behind it cannot start, and the loop waits for the release instead of spinning a
    core the threads serving that read need."""
    engine = Engine(EngineConfig(num_kv_blocks=4, block_size=16))
    steps, step = [0], engine.step
    monkeypatch.setattr(engine, "step", lambda: steps.__setitem__(0, steps[0] + 1) or step())
    loop = EngineLoop(engine)
    try:
        first = loop.submit("pinned", list(range(100, 140)), SamplingParams(max_tokens=1), prefill_only=True)
        assert first.get(timeout=60).finish_reason == "prefilled"  # 3 of the 4 blocks stay pinned
        second = loop.submit("waiting", list(range(300, 330)), SamplingParams(max_tokens=1))
        time.sleep(0.5)
        stalled_steps = steps[0]
        time.sleep(1.0)
        assert steps[0] - stalled_steps <= 20  # one step per 0.1 s wait at most (spinning: thousands)
        assert loop.call(engine.release, "pinned")
        assert second.get(timeout=60).finished
    finally:
        loop.stop()



def test_a_stopped_loop_leaves_nobody_waiting(engine, prompts):
    """Streams still running end "abort", and later commands fail: a handler blocked on either
    kept its worker process from exiting after a drain that ran out of time."""
    loop = EngineLoop(engine)
    outputs = loop.submit("cut-off", prompts[0], SamplingParams(max_tokens=10_000, ignore_eos=True))
    outputs.get(timeout=60)  # it runs
    loop.stop()
    assert _last(outputs).finish_reason == "abort"
    with pytest.raises(RuntimeError, match="the engine loop has stopped"):
        loop.call(engine.abort, "cut-off")
    engine.abort("cut-off")  # the engine is the session's: leave it empty
    assert not engine.has_unfinished()


def test_a_loop_stuck_in_a_step_reports_trouble(engine, prompts, monkeypatch):
    """What stops a worker's heartbeats (serving/registry_client.py) and turns its health checks
    NOT_SERVING (serving/engine_health.py), so the router routes elsewhere."""
    stuck, step = threading.Event(), engine.step
    monkeypatch.setattr(engine, "step", lambda: stuck.wait(60) and step())
    loop = EngineLoop(engine)
    try:
        assert not loop.trouble(30.0)
        outputs = loop.submit("stuck", prompts[0], SamplingParams(max_tokens=1))
        time.sleep(0.5)
        assert "in one step for over 0.2 s" in loop.trouble(0.2) and not loop.trouble(30.0)
        stuck.set()
        assert outputs.get(timeout=60).finished
        time.sleep(0.3)
        assert not loop.trouble(0.2)  # it comes round again
    finally:
        stuck.set()
        loop.stop()



@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's death, on purpose
def test_a_loop_whose_thread_died_leaves_nobody_waiting(engine, prompts, monkeypatch):
    """Commands were still queued after the loop's thread died, and nothing ran them: every decode
    stream, prefill and Abort waited forever, holding its call slot, until the worker stopped."""
    loop = EngineLoop(engine)
    try:
        outputs = loop.submit("orphan", prompts[0], SamplingParams(max_tokens=512, ignore_eos=True))
        monkeypatch.setattr(engine, "has_unfinished", lambda: 1 / 0)  # a fault outside any step's guard
        wait_until(lambda: loop.trouble() == "the engine loop's thread has died", "the loop thread lives on", 30)
        with pytest.raises(RuntimeError, match="stopped"):
            loop.post(lambda: None).result(timeout=10)
        while not (out := outputs.get(timeout=10)).finished:
            pass
        assert out.finish_reason == "error"
    finally:
        loop.stop()
        monkeypatch.undo()
        engine.abort("orphan")

def test_a_loop_whose_steps_keep_failing_reports_trouble_until_one_succeeds(engine, prompts, monkeypatch):
    """A poisoned device fails every step, while the loop itself keeps coming round."""
    from engine.loop import FAILED_STEPS_LIMIT

    failing, step = threading.Event(), engine.step
    monkeypatch.setattr(engine, "step", lambda: step() if not failing.is_set() else 1 / 0)
    loop = EngineLoop(engine)
    try:
        failing.set()
        for i in range(FAILED_STEPS_LIMIT):
            assert not loop.trouble()
            assert loop.submit(f"doomed-{i}", prompts[0], SamplingParams(max_tokens=2)).get(timeout=60).finish_reason == "error"
        assert loop.trouble() == f"the engine's last {FAILED_STEPS_LIMIT} steps failed"
        failing.clear()
        assert loop.submit("fine", prompts[0], SamplingParams(max_tokens=1)).get(timeout=60).finish_reason == "length"
        assert not loop.trouble()
    finally:
        loop.stop()


def test_the_loop_thread_holds_inference_mode(engine, prompts):
    """The loop's thread stays in inference mode (entered in every engine call, it cost an EAGLE3
    step that drafts 2-4 %); a caller outside it gets a step in inference mode all the same, its
    own mode kept, and the same tokens."""
    probe = inference(torch.is_inference_mode_enabled)
    loop = EngineLoop(engine)
    try:
        assert loop.call(torch.is_inference_mode_enabled)
        outputs = loop.submit("held", prompts[0], SamplingParams(max_tokens=12))
        held = _tokens(outputs)
    finally:
        loop.stop()
    assert probe() and not torch.is_inference_mode_enabled()  # entered for the call, left after it
    with torch.inference_mode():
        assert probe()
    assert [t for out in engine.generate(prompts[0], SamplingParams(max_tokens=12)) for t in out.token_ids] == held
    assert not torch.is_inference_mode_enabled()


def _tokens(outputs) -> list[int]:
    tokens = []
    while True:
        out = outputs.get(timeout=60)
        tokens += out.token_ids
        if out.finished:
            return tokens
