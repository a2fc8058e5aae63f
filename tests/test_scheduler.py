"""The scheduler's prefill choices, without a model: chunks priced by their context on CPU, a
newcomer beside a long prompt, and no prompt left behind."""

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


def _scheduler(context_cost: float | None, cap: int = 64) -> Scheduler:
    config = EngineConfig(long_prefill_token_threshold=cap, num_kv_blocks=1024)
    return Scheduler(config, BlockManager(config.num_kv_blocks, config.block_size), context_cost=context_cost)


def _add(scheduler: Scheduler, name: str, length: int) -> Sequence:
    seq = Sequence.new(name, [100 + (i % 5000) for i in range(length)], SamplingParams())
    scheduler.add(seq)
    return seq


def _step(scheduler: Scheduler) -> dict[str, int]:
    """One schedule, its chunks run: {sequence: tokens computed}; a finished prompt gets a token."""
    done = {}
    for item in scheduler.schedule(lambda seq: 0):
        item.seq.num_computed += item.num_tokens
        if item.seq.num_computed == len(item.seq.token_ids):
            item.seq.token_ids.append(0)
        done[item.seq.seq_id] = item.num_tokens
    return done


def test_chunks_shrink_as_the_context_grows_and_cost_at_most_the_cap():
    scheduler = _scheduler(context_cost=100.0)
    long = _add(scheduler, "long", 2000)
    chunks = []
    while long.num_computed < 2000:
        position = long.num_computed
        chunks.append(_step(scheduler)["long"])
        assert chunks[-1] == 1 or chunks[-1] * (1 + position / 100) <= 64
    assert chunks[0] == 64 and chunks[1] == int(64 / 1.64) and chunks[-1] < chunks[1]
    assert all(a >= b for a, b in zip(chunks, chunks[1:]))


def test_without_a_context_cost_a_chunk_is_the_cap_in_tokens():
    scheduler = _scheduler(context_cost=None)
    long = _add(scheduler, "long", 1000)
    assert [_step(scheduler)["long"] for _ in range(3)] == [64, 64, 64] and long.num_computed == 192


def test_a_newcomer_runs_alone_then_the_long_prompt_goes_first():
    scheduler = _scheduler(context_cost=100.0)
    long = _add(scheduler, "long", 3000)
    for _ in range(5):
        _step(scheduler)
    _add(scheduler, "short", 40)
    assert _step(scheduler) == {"short": 40}  # alone: the long prompt's chunk waits a step
    position = long.num_computed
    # then the short one decodes beside the long prompt's next chunk, priced as before
    assert _step(scheduler) == {"short": 1, "long": int(64 / (1 + position / 100))}


def test_no_prompt_starves_beside_a_stream_of_newcomers():
    scheduler = _scheduler(context_cost=100.0)
    long = _add(scheduler, "long", 3000)
    progress = []
    for k in range(20):
        _add(scheduler, f"short-{k}", 30)
        before = long.num_computed
        _step(scheduler)
        progress.append(long.num_computed > before)
    assert all(a or b for a, b in zip(progress, progress[1:]))  # at least every other step


def test_short_prompts_that_arrive_together_prefill_together():
    scheduler = _scheduler(context_cost=100.0)
    for k in range(4):
        _add(scheduler, f"short-{k}", 40 + k)
    assert _step(scheduler) == {f"short-{k}": 40 + k for k in range(4)}


def test_prompts_that_no_step_finishes_prefill_together():
    scheduler = _scheduler(context_cost=100.0)
    seqs = [_add(scheduler, f"p{k}", 256) for k in range(8)]
    assert _step(scheduler) == {f"p{k}": 64 for k in range(8)}
    while any(s.num_computed < 256 for s in seqs):
        assert len(_step(scheduler)) == 8


def test_draft_slots_never_cost_a_younger_sequence_its_place():
    """Every decoding sequence gets its token's slot first; draft slots only where room is left
    (an older sequence's 16 drafts used to take the last block and preempt the younger one)."""
    config = EngineConfig(num_kv_blocks=4, enable_prefix_caching=False)
    blocks = BlockManager(config.num_kv_blocks, config.block_size, enable_prefix_caching=False)
    scheduler = Scheduler(config, blocks)
    seqs = [_add(scheduler, name, config.block_size) for name in "ab"]  # a whole block each
    assert _step(scheduler) == {"a": config.block_size, "b": config.block_size}
    for seq in seqs:  # the prompt's KV is in: the next token needs a block of its own
        blocks.commit(seq.seq_id, seq.token_ids[: config.block_size])
    scheduled = scheduler.schedule(lambda seq: 16)
    assert [(s.seq.seq_id, s.num_tokens, s.num_lookahead) for s in scheduled] == [("a", 1, 0), ("b", 1, 0)]
    assert [s.seq_id for s in scheduler.running] == ["a", "b"]


def test_a_prompt_admitted_with_one_token_left_runs_in_the_step_that_admits_it():
    """A 1-token prompt (or one cached but for its last token) is computed in the step that admits
    it; it used to miss both that step's decoding and its prompt chunks (nothing scheduled: the
    engine loop then naps 0.1 s)."""
    scheduler = _scheduler(context_cost=None)
    _add(scheduler, "one", 1)
    assert _step(scheduler) == {"one": 1}


def test_draft_slots_come_out_of_the_steps_token_budget():
    """A verification row is a row of the step's forward like a prompt token: 3 decoding sequences
    wanting 8 drafts each in a 16-token budget get 13 draft slots between them (oldest first), and a
    waiting prompt waits for the next step instead of lengthening this one; in that next step its
    chunk comes before the drafts (it waited for good while every step drafted)."""
    config = EngineConfig(num_kv_blocks=64, max_num_batched_tokens=16)
    scheduler = Scheduler(config, BlockManager(config.num_kv_blocks, config.block_size))
    for name in "abc":
        _add(scheduler, name, 4)
    assert _step(scheduler) == {"a": 4, "b": 4, "c": 4}
    _add(scheduler, "late", 8)
    scheduled = scheduler.schedule(lambda seq: 8)
    assert [(s.seq.seq_id, s.num_tokens, s.num_lookahead) for s in scheduled] == [("a", 1, 8), ("b", 1, 5),
                                                                                 ("c", 1, 0)]
    assert sum(s.num_tokens + s.num_lookahead for s in scheduled) == 16
    scheduled = scheduler.schedule(lambda seq: 8)  # (as if the step ran: its drafts rejected)
    assert [(s.seq.seq_id, s.num_tokens, s.num_lookahead) for s in scheduled] == [("a", 1, 5), ("b", 1, 0),
                                                                                 ("c", 1, 0), ("late", 8, 0)]


def test_the_blocks_queued_requests_fill_are_counted_through_admission_preemption_and_removal():
    """A worker's load counts its queue's blocks (routing saw a backlog vanish at each heartbeat);
    the count follows every way in and out of the queue, and ends at zero."""
    config = EngineConfig(num_kv_blocks=6, max_num_seqs=2, enable_prefix_caching=False)
    blocks = BlockManager(config.num_kv_blocks, config.block_size, enable_prefix_caching=False)
    scheduler = Scheduler(config, blocks)
    a, b, c = (_add(scheduler, name, n) for name, n in (("a", 20), ("b", 33), ("c", 5)))
    assert scheduler.waiting_blocks == 2 + 3 + 1
    _step(scheduler)  # a and b admitted (the batch holds two)
    assert [s.seq_id for s in scheduler.waiting] == ["c"] and scheduler.waiting_blocks == 1
    scheduler._preempt(b)  # back to the queue's front, its tokens to compute again (its new one too)
    assert scheduler.waiting_blocks == 1 + 3
    scheduler.remove(c)
    scheduler.remove(b)
    scheduler.remove(a)
    assert scheduler.waiting_blocks == 0 and not scheduler.has_unfinished()



def test_a_waiting_prompt_takes_the_last_blocks_before_drafts_do():
    """Draft slots are speculation; a prompt waiting for the pool is a request. The pool's last
    block goes to the prompt (admitted this step), and the running sequence decodes without drafts
    (drafts took it first, and the prompt waited, blocks of a cached prefix evicted for them)."""
    config = EngineConfig(num_kv_blocks=3, block_size=16)
    scheduler = Scheduler(config, BlockManager(config.num_kv_blocks, config.block_size), context_cost=None)
    old = _add(scheduler, "old", 16)
    assert _step(scheduler) == {"old": 16}  # prefilled: one block, and its first token
    scheduler.blocks.commit("old", old.token_ids[:16])  # as the engine commits a forward's tokens
    scheduler.add(Sequence.new("new", list(range(6000, 6016)), SamplingParams()))  # no prefix of old's
    scheduled = {s.seq.seq_id: s for s in scheduler.schedule(lambda seq: 16 if seq is old else 0)}
    assert scheduled["new"].num_tokens == 16  # admitted and prefilled at once
    assert (scheduled["old"].num_tokens, scheduled["old"].num_lookahead) == (1, 0)
