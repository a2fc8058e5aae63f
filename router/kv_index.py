"""The router's view of every worker's prefix cache, rebuilt from the workers' KV events.

Workers hash their full KV blocks with `engine.hashing` (a chain: a block's hash covers its whole
prefix) and report BlockStored / BlockRemoved / AllBlocksCleared in heartbeats. The index maps
hash -> workers holding it, which is all a flat chain needs: unlike Dynamo's radix tree we never
walk parents, so `BlockStored.parent_hash` is not used. Not thread-safe: the registry's lock
guards it.
"""

from collections.abc import Iterable, Sequence

from proto.pdspec.v1 import kv_pb2


class KVIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}  # block hash -> worker ids
        self._blocks: dict[str, set[int]] = {}  # worker id -> block hashes (for clear/evict)

    def store(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        held = self._blocks.setdefault(worker_id, set())
        for h in block_hashes:
            held.add(h)
            self._holders.setdefault(h, set()).add(worker_id)

    def remove(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        held = self._blocks.get(worker_id, set())
        for h in block_hashes:
            held.discard(h)
            self._forget(h, worker_id)

    def clear(self, worker_id: str) -> None:
        """Drop everything `worker_id` holds (AllBlocksCleared, re-registration, eviction)."""
        for h in self._blocks.pop(worker_id, set()):
            self._forget(h, worker_id)

    def apply(self, worker_id: str, event: kv_pb2.KVEvent) -> None:
        kind = event.WhichOneof("event")
        if kind == "stored":
            self.store(worker_id, event.stored.block_hashes)
        elif kind == "removed":
            self.remove(worker_id, event.removed.block_hashes)
        elif kind == "cleared":
            self.clear(worker_id)

    def num_blocks(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    def overlaps(self, chain: Sequence[int]) -> dict[str, int]:
        """Per worker, how many leading blocks of `chain` it holds (workers with none are absent).

        A worker's run ends at its first missing block even if it holds later ones: a chain hash
        implies its prefix, but events can arrive out of step, and only a gapless prefix is reusable.
        """
        overlap: dict[str, int] = {}
        alive: set[str] | None = None
        for depth, h in enumerate(chain, start=1):
            holders = self._holders.get(h, set())
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            overlap.update(dict.fromkeys(alive, depth))
        return overlap

    def _forget(self, block_hash: int, worker_id: str) -> None:
        holders = self._holders.get(block_hash)
        if holders is None:
            return
        holders.discard(worker_id)
        if not holders:
            del self._holders[block_hash]
