"""Turn scheduled per-sequence chunks into one flat `ForwardBatch`."""

from dataclasses import dataclass

import torch

from engine.attention import SHORT_QUERY, AttentionMetadata


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attention: AttentionMetadata
    logits_indices: torch.Tensor  # [n] rows whose logits are wanted
    return_aux: bool = False  # also return the EAGLE3 auxiliary hidden states of every row


@dataclass
class SeqChunk:
    """Tokens of one sequence to run in a forward, starting at position `start`."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    num_logits: int  # logits wanted for the last `num_logits` tokens (0: none, e.g. a non-final prefill chunk)
    # A tree-shaped verification span (see spec/proposer.py): the chunk is [root] + drafts, and
    # draft i continues draft parents[i] (-1: the root). None: the tokens form a chain.
    draft_parents: list[int] | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


def slot_mapping(chunk: SeqChunk, block_size: int) -> list[int]:
    table = chunk.block_table
    return [table[p // block_size] * block_size + p % block_size for p in range(chunk.start, chunk.end)]


def tree_layout(parents: list[int]) -> tuple[list[int], list[int]]:
    """Per token of [root] + drafts: its depth below the root, and the bitmask of the tokens it
    sees (itself and its ancestors; bit j = token j)."""
    depths, masks = [0], [1]
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"draft {i} names parent {parent}: parents must precede their children")
        depths.append(depths[parent + 1] + 1)
        masks.append(masks[parent + 1] | 1 << (i + 1))
    return depths, masks


def build_batch(chunks: list[SeqChunk], block_size: int, device: torch.device, return_aux: bool = False) -> ForwardBatch:
    ids, positions, slots, logits_rows, span_masks = [], [], [], [], []
    row = 0
    for c in chunks:
        ids.extend(c.token_ids)
        slots.extend(slot_mapping(c, block_size))
        if c.draft_parents is None:
            positions.extend(range(c.start, c.end))
            span_masks.extend([-1] * len(c.token_ids))  # causal
        else:
            # Tokens take consecutive slots, but their positions (RoPE) are by depth in the tree.
            if len(c.token_ids) != len(c.draft_parents) + 1 or len(c.token_ids) > SHORT_QUERY:
                raise ValueError(f"a tree span is [root] + at most {SHORT_QUERY - 1} drafts, one parent each")
            depths, masks = tree_layout(c.draft_parents)
            positions.extend(c.start + d for d in depths)
            span_masks.extend(masks)
        row += len(c.token_ids)
        logits_rows.extend(range(row - c.num_logits, row))
    meta = AttentionMetadata.build(
        query_lens=[len(c.token_ids) for c in chunks],
        context_lens=[c.end for c in chunks],
        block_tables=[c.block_table for c in chunks],
        slot_mapping=slots,
        block_size=block_size,
        device=device,
        span_masks=span_masks if any(c.draft_parents is not None for c in chunks) else None,
    )
    longs, t = torch.tensor(ids + positions + logits_rows, dtype=torch.long, device=device), len(ids)  # one tensor
    return ForwardBatch(input_ids=longs[:t], positions=longs[t : 2 * t], attention=meta, logits_indices=longs[2 * t :],
                        return_aux=return_aux)
