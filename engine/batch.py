"""Turn scheduled per-sequence chunks into one flat `ForwardBatch`."""

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.model import ForwardBatch


@dataclass
class SeqChunk:
    """Tokens of one sequence to run in a forward, starting at position `start`."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    num_logits: int  # logits wanted for the last `num_logits` tokens (0: none, e.g. a non-final prefill chunk)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


def slot_mapping(chunk: SeqChunk, block_size: int) -> list[int]:
    table = chunk.block_table
    return [table[p // block_size] * block_size + p % block_size for p in range(chunk.start, chunk.end)]


def build_batch(chunks: list[SeqChunk], block_size: int, device: torch.device, return_aux: bool = False) -> ForwardBatch:
    ids, positions, slots, logits_rows = [], [], [], []
    row = 0
    for c in chunks:
        ids.extend(c.token_ids)
        positions.extend(range(c.start, c.end))
        slots.extend(slot_mapping(c, block_size))
        row += len(c.token_ids)
        logits_rows.extend(range(row - c.num_logits, row))
    meta = AttentionMetadata.build(
        query_lens=[len(c.token_ids) for c in chunks],
        context_lens=[c.end for c in chunks],
        block_tables=[c.block_table for c in chunks],
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_size=block_size,
        device=device,
    )
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        attention=meta,
        logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=device),
        return_aux=return_aux,
    )
