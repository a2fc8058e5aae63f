"""Block manager: unit tests for each rule, then a stateful property test against a reference model."""

import copy

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_manager import (
    AllBlocksCleared,
    BlockManager,
    BlockRemoved,
    BlockStored,
    KVEvent,
    NoFreeBlocksError,
)
from engine.hashing import ROOT_PARENT_HASH, hash_block, hash_blocks

BS = 4


class Replay:
    """Subscriber that rebuilds the set of cached hashes from events alone, as the router does."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.events: list[KVEvent] = []
        self.undrained = 0  # events[undrained:] are new since the last drain()

    def drain(self) -> list[KVEvent]:
        new, self.undrained = self.events[self.undrained :], len(self.events)
        return new

    def __call__(self, event: KVEvent) -> None:
        self.events.append(event)
        if isinstance(event, BlockStored):
            assert self.hashes.isdisjoint(event.block_hashes), "block stored twice"
            parent = event.parent_hash
            for i, block_hash in enumerate(event.block_hashes):
                block_tokens = event.token_ids[i * event.block_size : (i + 1) * event.block_size]
                parent = hash_block(parent, block_tokens)
                assert parent == block_hash, "BlockStored chain does not match its tokens"
            self.hashes.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert self.hashes.issuperset(event.block_hashes), "removed a block that was never stored"
            self.hashes.difference_update(event.block_hashes)
        else:
            assert isinstance(event, AllBlocksCleared)
            self.hashes.clear()


def make(num_blocks: int = 8, block_size: int = BS) -> tuple[BlockManager, Replay]:
    bm = BlockManager(num_blocks, block_size)
    replay = Replay()
    bm.subscribe(replay)
    return bm, replay


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def state(bm: BlockManager) -> dict:
    """Deep copy of all manager state, to assert that a failed operation changed nothing."""
    return {k: copy.deepcopy(v) for k, v in vars(bm).items() if k != "_subscribers"}


def ref_counts(bm: BlockManager) -> list[int]:
    return [block.ref_count for block in bm._blocks]


def run_prompt(bm: BlockManager, seq_id: str, prompt: list[int]) -> int:
    """Allocate and prefill a prompt: commit all of it."""
    hit = bm.allocate(seq_id, prompt)
    bm.commit(seq_id, prompt[hit:])
    return hit


# ---- allocation and prefix cache ----


def test_allocate_reserves_prompt_slots():
    bm, _ = make()
    assert bm.allocate("a", list(range(10))) == 0
    assert len(bm.block_table("a")) == 3
    assert (bm.num_committed("a"), bm.num_reserved("a")) == (0, 10)
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 5


def test_prefix_hit_shares_blocks_across_sequences():
    bm, replay = make()
    prompt = list(range(10))
    run_prompt(bm, "a", prompt)
    assert bm.block_hashes("a") == hash_blocks(prompt, BS)
    assert bm.cached_hashes() == set(hash_blocks(prompt, BS)) == replay.hashes

    assert bm.get_num_cached_tokens(prompt[:8] + [99]) == 8
    assert bm.allocate("b", prompt[:8] + [99]) == 8
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.block_table("b")[2] != bm.block_table("a")[2]
    assert (bm.num_committed("b"), bm.num_reserved("b")) == (8, 1)
    assert bm.block_hashes("b") == hash_blocks(prompt, BS)
    counts = ref_counts(bm)
    assert [counts[b] for b in bm.block_table("a")] == [2, 2, 1]


def test_no_hit_when_an_earlier_block_differs():
    bm, _ = make()
    prompt = list(range(10))
    run_prompt(bm, "a", prompt)
    other = [42] + prompt[1:]  # block 1 has the same tokens, but its chain differs
    assert bm.get_num_cached_tokens(other) == 0
    assert bm.allocate("b", other) == 0


def test_hit_leaves_at_least_one_token_to_compute():
    bm, _ = make()
    prompt = list(range(8))
    run_prompt(bm, "a", prompt)
    assert bm.get_num_cached_tokens(prompt) == 4  # not 8: the last token must produce logits
    assert bm.get_num_cached_tokens(prompt + [8]) == 8
    assert bm.get_num_cached_tokens(prompt[:4]) == 0
    assert bm.get_num_cached_tokens([]) == 0
    assert bm.allocate("b", prompt) == 4
    assert bm.num_reserved("b") == 4


def test_identical_full_block_registered_once():
    bm, replay = make()
    prompt = list(range(5))
    bm.allocate("a", prompt)
    bm.allocate("b", prompt)  # nothing cached yet: both compute it
    bm.commit("a", prompt)
    bm.commit("b", prompt)
    stored = [e for e in replay.events if isinstance(e, BlockStored)]
    assert len(stored) == 1 and stored[0].block_hashes == hash_blocks(prompt, BS)
    assert bm.block_hashes("b") == bm.block_hashes("a")
    assert bm.block_table("b")[0] != bm.block_table("a")[0]
    free_before = bm.num_free_blocks
    bm.free("b")  # b's duplicate block is not cached: straight back to the free list
    assert bm.num_free_blocks == free_before + 2
    assert bm.cached_hashes() == set(hash_blocks(prompt, BS)) == replay.hashes


def test_block_cached_only_once_all_its_tokens_are_committed():
    bm, replay = make()
    bm.allocate("a", [1, 2, 3])
    bm.commit("a", [1, 2, 3])
    assert bm.reserve("a", 5)  # slots 3..7: block 0 and block 1 fully reserved
    assert bm.cached_hashes() == set() and bm.block_hashes("a") == []
    bm.commit("a", [])
    assert bm.cached_hashes() == set()
    bm.commit("a", [4])
    assert bm.block_hashes("a") == hash_blocks([1, 2, 3, 4], BS)
    assert bm.cached_hashes() == replay.hashes == set(bm.block_hashes("a"))
    bm.commit("a", [5, 6, 7])
    assert bm.cached_hashes() == set(bm.block_hashes("a")[:1])  # block 1 holds 3 of 4


def test_commit_filling_several_blocks_emits_one_chained_event():
    bm, replay = make()
    tokens = list(range(13))
    bm.allocate("a", tokens)
    replay.drain()
    bm.commit("a", tokens[:4])
    bm.commit("a", tokens[4:])
    first, second = replay.drain()
    hashes = hash_blocks(tokens, BS)
    assert first == BlockStored(hashes[:1], ROOT_PARENT_HASH, tokens[:4], BS)
    assert second == BlockStored(hashes[1:], hashes[0], tokens[4:12], BS)


def test_every_subscriber_sees_every_event():
    bm, replay = make(num_blocks=2)
    second = Replay()
    bm.subscribe(second)
    run_prompt(bm, "a", list(range(5)))
    bm.free("a")
    run_prompt(bm, "b", [7] * 8)  # evicts a's block
    bm.clear_prefix_cache()
    assert second.events == replay.events
    assert [type(e) for e in replay.events] == [BlockStored, BlockRemoved, BlockStored, AllBlocksCleared, BlockStored]


# ---- reserve / commit / rollback ----


@pytest.mark.parametrize(("committed", "num_slots", "blocks"), [(14, 6, 2), (15, 20, 3), (16, 16, 2), (15, 1, 1)])
def test_reserve_crosses_block_boundaries(committed, num_slots, blocks):
    bm, _ = make(num_blocks=8, block_size=16)
    bm.allocate("a", list(range(committed)))
    bm.commit("a", list(range(committed)))
    assert bm.reserve("a", num_slots)
    assert len(bm.block_table("a")) == blocks
    assert bm.num_reserved("a") == num_slots


def test_rollback_releases_blocks_beyond_committed():
    bm, _ = make()
    bm.allocate("a", [1] * 6)
    bm.commit("a", [1] * 6)
    assert bm.reserve("a", 9)  # K+1 speculative slots: 15 -> 4 blocks
    assert len(bm.block_table("a")) == 4
    bm.commit("a", [2, 3, 4])  # 9 committed: block 2 partially holds them
    bm.rollback("a")
    assert (bm.num_committed("a"), bm.num_reserved("a"), len(bm.block_table("a"))) == (9, 0, 3)
    assert bm.num_free_blocks == 5
    bm.rollback("a")  # nothing reserved: no-op
    assert len(bm.block_table("a")) == 3


def test_reserve_fails_cleanly_when_short():
    bm, _ = make(num_blocks=3)
    bm.allocate("a", [1] * 5)
    bm.commit("a", [1] * 5)
    before = state(bm)
    assert not bm.reserve("a", 8)  # needs 2 more blocks, 1 free
    assert state(bm) == before
    assert bm.reserve("a", 7)
    assert bm.num_free_blocks == 0


def test_allocate_fails_cleanly_and_counts_evictable_hits():
    bm, replay = make(num_blocks=4)
    prefix = list(range(8))
    run_prompt(bm, "a", prefix + [8])
    bm.free("a")  # 2 cached evictable blocks + 2 free
    assert bm.num_free_blocks == 4
    # 5 blocks, 2 of them hits: 3 new needed, but only 2 remain once the evictable hits are taken.
    too_long = prefix + [9] * 12
    assert bm.get_num_cached_tokens(too_long) == 8
    before = state(bm)
    assert not bm.can_allocate(too_long)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("b", too_long)
    assert state(bm) == before
    fits = prefix + [9] * 8
    assert bm.can_allocate(fits)
    assert bm.allocate("b", fits) == 8
    assert bm.num_free_blocks == 0 and bm.cached_hashes() == replay.hashes


def test_commit_more_than_reserved_is_rejected():
    bm, _ = make()
    bm.allocate("a", [1, 2])
    before = state(bm)
    with pytest.raises(ValueError):
        bm.commit("a", [1, 2, 3])
    assert state(bm) == before


# ---- free and eviction ----


def test_free_sends_cached_blocks_to_lru_and_others_to_free_list():
    bm, _ = make()
    run_prompt(bm, "a", list(range(6)))  # one full cached block, one partial
    bm.free("a")
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    assert bm.cached_hashes() == set(hash_blocks(list(range(6)), BS))
    assert bm.allocate("b", list(range(5))) == 4  # still reusable after free


def test_eviction_is_lru_by_release_time_and_emits_block_removed():
    bm, replay = make(num_blocks=4)
    prompts = {name: [i] * 4 for i, name in enumerate("abc")}  # one full cached block each
    for name, prompt in prompts.items():
        run_prompt(bm, name, prompt)
    for name in "bac":  # release order b, a, c
        bm.free(name)
    hash_of = {name: hash_blocks(prompt, BS)[0] for name, prompt in prompts.items()}
    replay.drain()
    run_prompt(bm, "d", [7] * 5)  # 2 blocks: the 1 truly free one, then evict b
    assert replay.drain() == [BlockRemoved([hash_of["b"]]), BlockStored(hash_blocks([7] * 4, BS), 0, [7] * 4, BS)]
    assert bm.allocate("e", [8] * 6) == 0  # 2 blocks: evict a, then c
    assert replay.drain() == [BlockRemoved([hash_of["a"], hash_of["c"]])]
    assert bm.cached_hashes() == replay.hashes == {hash_blocks([7] * 4, BS)[0]}


def test_free_releases_tail_first_so_the_head_survives_longest():
    bm, replay = make(num_blocks=3)
    prompt = list(range(12))
    bm.allocate("a", prompt)
    bm.commit("a", prompt)
    bm.free("a")
    hashes = hash_blocks(prompt, BS)
    replay.drain()
    bm.allocate("b", [50] * 4)
    assert replay.drain() == [BlockRemoved([hashes[2]])]
    assert bm.get_num_cached_tokens(prompt) == 8


def test_hit_on_evictable_block_takes_it_off_the_lru():
    bm, replay = make(num_blocks=3)
    run_prompt(bm, "a", [1] * 5)
    bm.free("a")
    assert bm.allocate("b", [1] * 4 + [2]) == 4
    replay.drain()
    bm.allocate("c", [3] * 4)  # the only free block
    assert replay.drain() == []
    assert not bm.can_allocate([3])  # the shared cached block is in use, not evictable


def test_clear_prefix_cache_keeps_blocks_in_use():
    bm, replay = make()
    run_prompt(bm, "a", list(range(9)))
    run_prompt(bm, "b", [5] * 5)
    bm.free("b")
    assert len(bm.cached_hashes()) == 3
    replay.drain()
    bm.clear_prefix_cache()
    hashes_a = hash_blocks(list(range(9)), BS)
    assert bm.cached_hashes() == set(hashes_a) == replay.hashes
    assert replay.drain() == [AllBlocksCleared(), BlockStored(hashes_a, ROOT_PARENT_HASH, list(range(8)), BS)]
    assert bm.get_num_cached_tokens([5] * 5) == 0
    bm.free("a")
    bm.clear_prefix_cache()
    assert bm.cached_hashes() == set() == replay.hashes
    assert bm.num_free_blocks == 8


def test_errors():
    bm, _ = make()
    unknown_id_calls = [
        lambda: bm.reserve("nope", 1),
        lambda: bm.commit("nope", [1]),
        *(lambda op=op: op("nope") for op in (bm.rollback, bm.free, bm.block_table, bm.num_committed)),
        *(lambda op=op: op("nope") for op in (bm.num_reserved, bm.block_hashes)),
    ]
    for call in unknown_id_calls:
        with pytest.raises(KeyError, match="nope"):
            call()
    with pytest.raises(ValueError):
        bm.allocate("a", [])
    bm.allocate("a", [1])
    before = state(bm)
    with pytest.raises(ValueError):
        bm.allocate("a", [1])
    with pytest.raises(ValueError):
        bm.reserve("a", -1)
    assert state(bm) == before
    with pytest.raises(ValueError):
        BlockManager(0)


# ---- stateful property test ----

JUNK = -1  # what a forward writes into a reserved slot before its token is committed
BASES = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3], [1, 2, 3, 1, 0, 0, 0, 0, 2, 2, 2, 2], [2] * 12]
TOKENS = st.integers(0, 3)
PROMPTS = st.builds(
    lambda base, n, tail: base[:n] + tail, st.sampled_from(BASES), st.integers(0, 12), st.lists(TOKENS, max_size=8)
).filter(len)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random workloads against a reference model that also simulates the KV contents of every slot.

    Forwards write JUNK into newly reserved slots and real tokens on commit. If blocks were shared wrongly, evicted while in use, or hit
    on a different prefix, some sequence's committed positions would read the wrong token.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bm, self.replay = make(num_blocks=12)
        self.seqs: dict[int, list[int]] = {}  # committed tokens
        self.reserved: dict[int, int] = {}
        self.prompt_rest: dict[int, list[int]] = {}  # prompt tokens reserved but not committed yet
        self.kv: dict[int, int] = {}  # slot -> token
        self.committed_prefixes: set[tuple[int, ...]] = set()  # every full-block prefix ever committed
        self.freed: list[list[int]] = []  # committed tokens of freed sequences with a full block
        self.next_id = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _slots(self, seq_id: int, start: int, end: int) -> list[int]:
        table = self.bm.block_table(seq_id)
        return [table[p // BS] * BS + p % BS for p in range(start, end)]

    def _forward(self, seq_id: int, start: int, end: int) -> None:
        """Write JUNK into positions [start, end) as a forward would."""
        for slot in self._slots(seq_id, start, end):
            self.kv[slot] = JUNK

    def _expected_hit(self, prompt: list[int]) -> int:
        cached = self.bm.cached_hashes()
        hit = 0
        for block_hash in hash_blocks(prompt[: len(prompt) - 1], BS):
            if block_hash not in cached:
                break
            hit += BS
        return hit

    def _sharers(self, block_id: int) -> int:
        return sum(self.bm.block_table(s).count(block_id) for s in self.seqs)

    @rule(prompt=PROMPTS)
    def allocate(self, prompt: list[int]) -> None:
        self._allocate(prompt)

    @precondition(lambda self: self.freed)
    @rule(data=st.data(), tail=st.lists(TOKENS, min_size=1, max_size=8))
    def allocate_after_freed(self, data: st.DataObject, tail: list[int]) -> None:
        """Continue a freed sequence's tokens, to hit on its evictable blocks."""
        self._allocate(data.draw(st.sampled_from(self.freed)) + tail)

    def _allocate(self, prompt: list[int]) -> None:
        seq_id, expected_hit = self._new_id(), self._expected_hit(prompt)
        assert self.bm.get_num_cached_tokens(prompt) == expected_hit
        # Hit blocks no sequence uses are evictable: counted as free, yet taken by this sequence itself.
        hit_blocks = [self.bm._hash_to_block[h] for h in hash_blocks(prompt[:expected_hit], BS)]
        idle_hits = sum(1 for block_id in hit_blocks if self._sharers(block_id) == 0)
        fits = cdiv(len(prompt), BS) - len(hit_blocks) <= self.bm.num_free_blocks - idle_hits
        assert self.bm.can_allocate(prompt) == fits
        if not fits:
            before = state(self.bm)
            with pytest.raises(NoFreeBlocksError):
                self.bm.allocate(seq_id, prompt)
            assert state(self.bm) == before
            return
        hit = self.bm.allocate(seq_id, prompt)
        assert hit == expected_hit
        assert hit == 0 or tuple(prompt[:hit]) in self.committed_prefixes
        self.seqs[seq_id], self.reserved[seq_id] = prompt[:hit], len(prompt) - hit
        self.prompt_rest[seq_id] = prompt[hit:]
        self._forward(seq_id, hit, len(prompt))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), num_slots=st.integers(0, 9))
    def reserve(self, data: st.DataObject, num_slots: int) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        committed, reserved, table = len(self.seqs[seq_id]), self.reserved[seq_id], self.bm.block_table(seq_id)
        needed = cdiv(committed + reserved + num_slots, BS) - len(table)
        before = state(self.bm)
        free_before = self.bm.num_free_blocks
        ok = self.bm.reserve(seq_id, num_slots)
        assert ok == (needed <= free_before)
        if not ok:
            assert state(self.bm) == before
            return
        self.reserved[seq_id] += num_slots
        self._forward(seq_id, committed + reserved, committed + reserved + num_slots)

    @precondition(lambda self: any(self.reserved.values()))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(s for s, r in self.reserved.items() if r)))
        # Often everything (a prefill, or all drafts accepted).
        count = data.draw(st.just(self.reserved[seq_id]) | st.integers(0, self.reserved[seq_id]))
        rest = self.prompt_rest[seq_id]
        from_prompt, num_generated = rest[:count], max(0, count - len(rest))
        tokens = from_prompt + data.draw(st.lists(TOKENS, min_size=num_generated, max_size=num_generated))
        del rest[:count]
        start = len(self.seqs[seq_id])
        self.bm.commit(seq_id, tokens)
        for slot, token in zip(self._slots(seq_id, start, start + count), tokens):
            self.kv[slot] = token
        self.seqs[seq_id] += tokens
        self.reserved[seq_id] -= count
        committed = self.seqs[seq_id]
        self.committed_prefixes.update(tuple(committed[:end]) for end in range(BS, len(committed) + 1, BS))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def commit_too_many(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        before = state(self.bm)
        with pytest.raises(ValueError):
            self.bm.commit(seq_id, [0] * (self.reserved[seq_id] + 1))
        assert state(self.bm) == before

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.rollback(seq_id)
        self.reserved[seq_id] = 0
        self.prompt_rest[seq_id] = []

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.free(seq_id)
        if len(self.seqs[seq_id]) >= BS:
            self.freed.append(self.seqs[seq_id])
        del self.seqs[seq_id], self.reserved[seq_id], self.prompt_rest[seq_id]

    @rule()
    def clear_prefix_cache(self) -> None:
        self.bm.clear_prefix_cache()

    @invariant()
    def pool_is_consistent(self) -> None:
        bm = self.bm
        free, evictable = list(bm._free), list(bm._evictable)
        assert len(set(free)) == len(free), "a block was freed twice"
        assert set(free).isdisjoint(evictable)
        memberships = [0] * bm.num_blocks
        for seq_id in self.seqs:
            for block_id in bm.block_table(seq_id):
                memberships[block_id] += 1
        assert ref_counts(bm) == memberships
        assert set(free) | set(evictable) == {b for b, n in enumerate(memberships) if n == 0}
        assert all(bm._blocks[b].hash is None for b in free)
        assert bm.num_free_blocks == len(free) + len(evictable)
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks

    @invariant()
    def prefix_cache_is_consistent(self) -> None:
        block_hashes = [block.hash for block in self.bm._blocks if block.hash is not None]
        assert len(set(block_hashes)) == len(block_hashes)
        assert self.bm.cached_hashes() == set(block_hashes) == self.replay.hashes

    @invariant()
    def sequences_match_model(self) -> None:
        for seq_id, tokens in self.seqs.items():
            committed, reserved = self.bm.num_committed(seq_id), self.bm.num_reserved(seq_id)
            assert (committed, reserved) == (len(tokens), self.reserved[seq_id])
            assert len(self.bm.block_table(seq_id)) == cdiv(committed + reserved, BS)  # enough, not more
            assert self.bm.block_hashes(seq_id) == hash_blocks(tokens, BS)
            assert [self.kv.get(slot) for slot in self._slots(seq_id, 0, committed)] == tokens

    def teardown(self) -> None:
        for seq_id in list(self.seqs):
            self.bm.free(seq_id)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert ref_counts(self.bm) == [0] * self.bm.num_blocks
        self.bm.clear_prefix_cache()
        assert self.bm.cached_hashes() == set() == self.replay.hashes


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_block_manager_state_machine = BlockManagerMachine.TestCase


def test_prefix_caching_disabled_never_hits_or_emits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    replay = Replay()
    bm.subscribe(replay)
    tokens = list(range(9))
    run_prompt(bm, "a", tokens)
    bm.free("a")
    assert bm.allocate("b", tokens) == 0
    assert bm.cached_hashes() == set() and replay.events == []
