"""What the block manager tests share: a subscriber that replays its events as the router does,
and helpers to build a manager and look at its state."""

import copy

from engine.block_manager import AllBlocksCleared, BlockManager, BlockRemoved, BlockStored, KVEvent
from engine.hashing import hash_block

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
