"""Paged KV-cache bookkeeping: block tables, refcounts, prefix cache and KV events. No tensors.

The cache is `num_blocks` blocks of `block_size` token slots. A sequence owns a block table and
holds `committed` tokens (their KV is final) followed by `reserved` slots (about to be computed,
or speculative and possibly rejected). Every full committed block is hashed with
`engine.hashing` -- the same chain the router's KV index uses -- and registered in the prefix
cache, so later prompts with the same prefix share it. A cached block nobody uses stays
reusable ("evictable") until the pool needs it; the least recently released goes first.

Invariant: a sequence has exactly ceil((committed + reserved) / block_size) blocks.
"""

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

from engine.hashing import ROOT_PARENT_HASH, hash_block

SeqId = Hashable


class NoFreeBlocksError(RuntimeError):
    """The pool cannot supply the blocks an allocation needs."""


@dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks entered the prefix cache; `parent_hash` is the hash of the block before the first."""

    block_hashes: list[int]
    parent_hash: int
    token_ids: list[int]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left the prefix cache (evicted)."""

    block_hashes: list[int]


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block was dropped; BlockStored events for the blocks still in use follow."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set exactly while the block is registered in the prefix cache


@dataclass(slots=True)
class _SeqBlocks:
    block_ids: list[int]
    token_ids: list[int]  # committed
    # Chained hashes of the full committed blocks. Kept per sequence because a block whose hash
    # was already registered by another block stays unregistered (Block.hash is None).
    block_hashes: list[int]
    num_reserved: int = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # ref 0, no hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed; least recently released first
        self._hash_to_block: dict[int, int] = {}
        self._seqs: dict[SeqId, _SeqBlocks] = {}
        self._subscribers: list[Callable[[KVEvent], None]] = []
        self.num_retired_blocks = 0  # see `retire`

    # ---- sequence lifecycle ----

    def can_allocate(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether `allocate` of this prompt would succeed now. Changes nothing."""
        _check_prompt(prompt_token_ids)
        hit_ids, _ = self._match_prefix(prompt_token_ids)
        return self._allocation_fits(len(prompt_token_ids), hit_ids)

    def allocate(self, seq_id: SeqId, prompt_token_ids: Sequence[int]) -> int:
        """Start a sequence: share its cached prefix, reserve slots for the rest. Returns the cached token count."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        _check_prompt(prompt_token_ids)
        hit_ids, hit_hashes = self._match_prefix(prompt_token_ids)
        num_tokens = len(prompt_token_ids)
        if not self._allocation_fits(num_tokens, hit_ids):
            raise NoFreeBlocksError(f"sequence {seq_id!r}: not enough free blocks for {num_tokens} tokens")
        for block_id in hit_ids:  # before taking new blocks, so eviction cannot pick them
            self._acquire(block_id)
        num_hit = len(hit_ids) * self.block_size
        new_ids = self._take_blocks(_cdiv(num_tokens, self.block_size) - len(hit_ids))
        self._seqs[seq_id] = _SeqBlocks(
            hit_ids + new_ids, list(prompt_token_ids[:num_hit]), hit_hashes, num_tokens - num_hit
        )
        return num_hit

    def reserve(self, seq_id: SeqId, num_slots: int) -> bool:
        """Reserve `num_slots` more slots after the current ones. False, changing nothing, if the pool is short."""
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        seq = self._seq(seq_id)
        needed = len(seq.token_ids) + seq.num_reserved + num_slots
        num_new = _cdiv(needed, self.block_size) - len(seq.block_ids)
        if num_new > self.num_free_blocks:
            return False
        seq.block_ids += self._take_blocks(num_new)
        seq.num_reserved += num_slots
        return True

    def commit(self, seq_id: SeqId, token_ids: Sequence[int]) -> None:
        """The first len(token_ids) reserved slots now hold these final tokens; cache the blocks they fill."""
        seq = self._seq(seq_id)
        if len(token_ids) > seq.num_reserved:
            raise ValueError(
                f"sequence {seq_id!r}: committing {len(token_ids)} tokens, only {seq.num_reserved} slots reserved"
            )
        seq.token_ids += token_ids
        seq.num_reserved -= len(token_ids)
        self._register_full_blocks(seq)

    def rollback(self, seq_id: SeqId) -> None:
        """Drop every remaining reserved slot and the blocks that hold no committed token."""
        seq = self._seq(seq_id)
        seq.num_reserved = 0
        keep = _cdiv(len(seq.token_ids), self.block_size)
        self._release(seq.block_ids[keep:])
        del seq.block_ids[keep:]

    def free(self, seq_id: SeqId) -> None:
        """Release all of the sequence's blocks; its cached ones stay reusable until evicted."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        # Tail first, so it is evicted first: the head is the likeliest prefix of future prompts.
        self._release(reversed(seq.block_ids))

    def retire(self, seq_id: SeqId) -> None:
        """End the sequence but keep every block it holds out of use for good: something outside
        our control (a KV transfer that could not be cancelled) may still write into them."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        # Its cached prefix blocks (shared, hashed) were nobody's to write: those go as in `free`.
        cached = [b for b in seq.block_ids if self._blocks[b].hash is not None]
        self._release(reversed(cached))
        self.num_retired_blocks += len(seq.block_ids) - len(cached)  # never released

    def clear_prefix_cache(self) -> None:
        """Evict every evictable cached block. Blocks in use keep their hashes."""
        for block_id in self._evictable:
            self._unregister(self._blocks[block_id])
            self._free.append(block_id)
        self._evictable.clear()
        self._emit(AllBlocksCleared())
        # Re-announce the cached blocks still in use so that event consumers stay exact.
        announced: set[int] = set()
        for seq in self._seqs.values():
            indices = []
            for i, block_id in enumerate(seq.block_ids[: len(seq.block_hashes)]):
                if self._blocks[block_id].hash is not None and block_id not in announced:
                    announced.add(block_id)
                    indices.append(i)
            self._emit_stored_runs(seq, indices)

    # ---- queries ----

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: truly free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """The pool but the blocks retired for good."""
        return self.num_blocks - self.num_retired_blocks

    def block_table(self, seq_id: SeqId) -> list[int]:
        return list(self._seq(seq_id).block_ids)

    def num_committed(self, seq_id: SeqId) -> int:
        return len(self._seq(seq_id).token_ids)

    def num_reserved(self, seq_id: SeqId) -> int:
        return self._seq(seq_id).num_reserved

    def block_hashes(self, seq_id: SeqId) -> list[int]:
        """Chained hashes of the sequence's full committed blocks."""
        return list(self._seq(seq_id).block_hashes)

    def cached_hashes(self) -> set[int]:
        return set(self._hash_to_block)

    def get_num_cached_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens `allocate(token_ids)` would find cached now (at most len-1, rounded to blocks). Changes nothing."""
        return len(self._match_prefix(token_ids)[0]) * self.block_size

    # ---- events ----

    def subscribe(self, callback: Callable[[KVEvent], None]) -> None:
        """Call `callback` with every event as it happens. It must not raise or call back into the manager."""
        self._subscribers.append(callback)

    def _emit(self, event: KVEvent) -> None:
        for callback in self._subscribers:
            callback(event)

    def _emit_stored_runs(self, seq: _SeqBlocks, indices: list[int]) -> None:
        """Announce `seq`'s full blocks at ascending `indices`: one BlockStored per consecutive run."""
        bs = self.block_size
        run_start = 0
        for k in range(1, len(indices) + 1):
            if k < len(indices) and indices[k] == indices[k - 1] + 1:
                continue
            first, end = indices[run_start], indices[k - 1] + 1
            tokens = seq.token_ids[first * bs : end * bs]
            self._emit(BlockStored(seq.block_hashes[first:end], self._parent_hash(seq, first), tokens, bs))
            run_start = k

    # ---- internals ----

    def _seq(self, seq_id: SeqId) -> _SeqBlocks:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    @staticmethod
    def _parent_hash(seq: _SeqBlocks, block_index: int) -> int:
        return seq.block_hashes[block_index - 1] if block_index else ROOT_PARENT_HASH

    def _match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """Block ids and hashes of the longest cached chain of the prompt's full blocks.

        Capped at (len-1) // block_size blocks: the last prompt token must be computed to get logits.
        """
        bs = self.block_size
        block_ids: list[int] = []
        hashes: list[int] = []
        parent = ROOT_PARENT_HASH
        if not self.enable_prefix_caching:
            return block_ids, hashes
        for start in range(0, (len(token_ids) - 1) // bs * bs, bs):
            parent = hash_block(parent, token_ids[start : start + bs])
            block_id = self._hash_to_block.get(parent)
            if block_id is None:
                break
            block_ids.append(block_id)
            hashes.append(parent)
        return block_ids, hashes

    def _allocation_fits(self, num_tokens: int, hit_ids: list[int]) -> bool:
        num_new = _cdiv(num_tokens, self.block_size) - len(hit_ids)
        # Evictable hit blocks count as free, but this sequence takes them itself.
        num_hit_evictable = sum(1 for block_id in hit_ids if self._blocks[block_id].ref_count == 0)
        return num_new <= self.num_free_blocks - num_hit_evictable

    def _register_full_blocks(self, seq: _SeqBlocks) -> None:
        """Hash the blocks newly filled with committed tokens; register those whose hash is new."""
        bs = self.block_size
        registered = []
        for i in range(len(seq.block_hashes), len(seq.token_ids) // bs):
            block_hash = hash_block(self._parent_hash(seq, i), seq.token_ids[i * bs : (i + 1) * bs])
            seq.block_hashes.append(block_hash)
            if self.enable_prefix_caching and block_hash not in self._hash_to_block:  # else keep the existing block; seq keeps its own
                self._hash_to_block[block_hash] = seq.block_ids[i]
                self._blocks[seq.block_ids[i]].hash = block_hash
                registered.append(i)
        self._emit_stored_runs(seq, registered)

    def _unregister(self, block: Block) -> None:
        assert block.hash is not None
        del self._hash_to_block[block.hash]
        block.hash = None

    def _acquire(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def _take_blocks(self, n: int) -> list[int]:
        """Take `n` blocks (the caller checked they exist): free ones first, then evict the LRU cached ones."""
        taken, evicted = [], []
        for _ in range(n):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                evicted.append(self._blocks[block_id].hash)
                self._unregister(self._blocks[block_id])
            self._blocks[block_id].ref_count = 1
            taken.append(block_id)
        if evicted:
            self._emit(BlockRemoved(evicted))
        return taken

    def _release(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} released more often than acquired")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self._free.append(block_id)
                else:
                    self._evictable[block_id] = None


def _check_prompt(prompt_token_ids: Sequence[int]) -> None:
    if not prompt_token_ids:
        raise ValueError("a prompt needs at least one token")
