"""Tensor parallelism inside one worker: the target's weights sharded over N ranks (processes).

Megatron-style: q/k/v and gate/up are column-parallel (each rank owns whole heads and a slice
of the MLP), o and down are row-parallel (partial sums, all-reduced), the LM head is
vocabulary-parallel (logit slices, all-gathered). The residual stream stays replicated, so the
EAGLE3 features and the draft (unsharded, on rank 0 only, as vLLM requires) see the full
hidden states. Each rank keeps its kv heads' KV cache.

Rank 0 drives: it runs the engine and, before every forward, broadcasts the batch's chunks to
the other ranks, which only run forwards (`ModelRunner.follow`; engine/runner.py starts and joins
the ranks' processes). gloo on CPU, NCCL on CUDA.
"""

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from engine.config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension (vocabulary slices -> full logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank (None is the stop signal)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shapes one rank computes with."""
        return replace(config, num_heads=config.num_heads // self.size, num_kv_heads=config.num_kv_heads // self.size,
                       intermediate_size=config.intermediate_size // self.size)

    def shard(self, config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slices of HF-named target weights (norms and embeddings stay whole)."""
        if self.size == 1:
            return weights
        d = config.head_dim
        rows = {  # output-dimension (row) slices of [out, in] weights: (rank-local size, weights)
            "q_proj": config.num_heads * d // self.size, "k_proj": config.num_kv_heads * d // self.size,
            "v_proj": config.num_kv_heads * d // self.size, "gate_proj": config.intermediate_size // self.size,
            "up_proj": config.intermediate_size // self.size,
        }
        cols = {"o_proj": config.num_heads * d // self.size, "down_proj": config.intermediate_size // self.size}
        out = {}
        for name, w in weights.items():
            kind = name.split(".")[-2] if name.count(".") >= 2 else ""
            if kind in rows:
                n = rows[kind]
                out[name] = w[self.rank * n : (self.rank + 1) * n].contiguous()
            elif kind in cols and name.endswith(".weight"):
                n = cols[kind]
                out[name] = w[:, self.rank * n : (self.rank + 1) * n].contiguous()
            elif kind in cols:  # a row-parallel layer's bias: added once, by rank 0, to the summed outputs
                out[name] = w if self.rank == 0 else torch.zeros_like(w)
            else:
                out[name] = w
        return out

    def vocab_slice(self, vocab_size: int) -> slice:
        n = vocab_size // self.size
        return slice(self.rank * n, (self.rank + 1) * n)
