"""The target's EAGLE3 features of token sequences, recomputed: what distillation stores per
position (the auxiliary layers' inputs and the last layer's output), from the tokens alone.

Stored features cost ~4.6 KB a token at fp16 (20M tokens: ~92 GB); tokens cost 4 bytes. One
prefill forward over a training batch's samples computes them again, row for row the bits the
decode steps of distillation computed (a row's result does not depend on what else the forward
runs), rounded to fp16 as the shards store them.
"""

from collections.abc import Iterator

import torch

from engine.batch import SeqChunk
from engine.config import EngineConfig
from engine.engine import Engine

FEATURE_DTYPE = torch.float16  # as distill.py stores them


def with_last_layer(engine: Engine, aux_layer_ids: tuple[int, ...] | None = None) -> None:
    """Make the target's auxiliary outputs a head's features (aux_layer_ids; None: EAGLE3's default)
    followed by its last layer's output (the teacher's logits are recomputed from it)."""
    model = engine.runner.model
    model.aux_layer_ids = (*(aux_layer_ids or model.aux_layer_ids), engine.runner.model_config.num_layers)


class TargetFeatures:
    def __init__(self, target: str | None, max_tokens: int, aux_layer_ids: tuple[int, ...] | None = None):
        """max_tokens: the most tokens one call computes (a training batch's); aux_layer_ids: the
        layers whose inputs are the features (None: EAGLE3's default, as distillation stores)."""
        block_size = 16
        self.engine = Engine(EngineConfig(model=target, num_kv_blocks=max_tokens // block_size + 64,
                                          block_size=block_size, max_num_batched_tokens=max_tokens,
                                          enable_prefix_caching=False))
        with_last_layer(self.engine, aux_layer_ids)
        self.hidden_size = self.engine.runner.model_config.hidden_size

    @torch.inference_mode()
    def __call__(self, samples: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sample: features [n, 3H] and final_hidden [n, H] (FEATURE_DTYPE), the last row zero
        as distillation leaves it (the target never ran on a sample's last token)."""
        return [features for group in self._groups(samples) for features in self._compute(group)]

    def _groups(self, samples: list[list[int]]) -> Iterator[list[list[int]]]:
        """Consecutive samples whose blocks fit the pool together: each takes whole blocks, so
        many short samples can need more than their tokens' worth (one forward each group)."""
        size, capacity = self.engine.config.block_size, self.engine.blocks.num_free_blocks
        group, need = [], 0
        for tokens in samples:
            blocks = -(-len(tokens) // size)
            if group and need + blocks > capacity:
                yield group
                group, need = [], 0
            group.append(tokens)
            need += blocks
        if group:
            yield group

    def _compute(self, samples: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        blocks, chunks = self.engine.blocks, []
        for i, tokens in enumerate(samples):
            blocks.allocate(f"sample-{i}", tokens)
            chunks.append(SeqChunk(list(tokens), 0, blocks.block_table(f"sample-{i}"), 0))
        try:
            aux = self.engine.runner.forward(chunks, return_aux=True).aux_hidden.to(FEATURE_DTYPE)
        finally:
            for i in range(len(samples)):
                blocks.free(f"sample-{i}")
        out, row = [], 0
        for tokens in samples:
            rows = aux[row : row + len(tokens)].clone()
            rows[-1] = 0
            out.append((rows[:, : -self.hidden_size], rows[:, -self.hidden_size :]))
            row += len(tokens)
        return out
