"""Block manager: unit tests for each rule (test_block_manager_model.py: a stateful property test
against a reference model)."""

import pytest

from engine.block_manager import AllBlocksCleared, BlockManager, BlockRemoved, BlockStored, NoFreeBlocksError
from engine.hashing import ROOT_PARENT_HASH, hash_blocks
from tests.block_manager_replay import BS, Replay, make, ref_counts, run_prompt, state

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


def test_retire_keeps_a_sequences_own_blocks_out_of_use_for_good():
    """A transfer that could not be cancelled may still write into the blocks it was given; the
    cached prefix it shared was never its to write, and goes as on free."""
    bm, _ = make()
    prompt = list(range(10))
    run_prompt(bm, "a", prompt)
    bm.allocate("b", prompt[:8] + [99])  # two cached blocks shared with a, one of its own
    own = bm.block_table("b")[2]
    bm.retire("b")
    assert bm.num_retired_blocks == 1 and bm.num_free_blocks == 4
    assert [ref_counts(bm)[b] for b in bm.block_table("a")] == [1, 1, 1]
    bm.free("a")
    assert bm.num_free_blocks == 7 and bm.num_used_blocks == 1
    for name in "bcdefgh":  # the pool's every other block, and the id again
        bm.allocate(name, [100 + ord(name)])
        assert own not in bm.block_table(name)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("i", [1])


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


def test_prefix_caching_disabled_never_hits_or_emits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    replay = Replay()
    bm.subscribe(replay)
    tokens = list(range(9))
    run_prompt(bm, "a", tokens)
    bm.free("a")
    assert bm.allocate("b", tokens) == 0
    assert bm.cached_hashes() == set() and replay.events == []
