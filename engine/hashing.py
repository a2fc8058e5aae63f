"""Chained block hashes: the one definition shared by the engine's prefix cache and the router.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal
prefixes (up to a 2^-64 collision). XXH3-64 over fixed-width little-endian bytes keeps it
deterministic across processes, machines and Python runs (unlike `hash()`).
"""

from collections.abc import Sequence
from array import array
import sys

import xxhash

ROOT_PARENT_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """XXH3-64 of the parent hash (u64 LE) followed by the token ids (u32 LE each)."""
    tokens = array("I", token_ids)
    if sys.byteorder != "little":
        tokens.byteswap()
    return xxhash.xxh3_64_intdigest(parent_hash.to_bytes(8, "little") + tokens.tobytes())


def hash_blocks(token_ids: Sequence[int], block_size: int, parent_hash: int = ROOT_PARENT_HASH) -> list[int]:
    """Hashes of every *full* block of `token_ids`, chained from `parent_hash`; a partial tail is not hashed."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size])
        hashes.append(parent_hash)
    return hashes
