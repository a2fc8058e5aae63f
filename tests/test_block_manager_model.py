"""Block manager: a stateful property test against a reference model that also simulates the KV
contents of every slot."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_manager import NoFreeBlocksError
from engine.hashing import hash_blocks
from tests.block_manager_replay import BS, cdiv, make, ref_counts, state


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
