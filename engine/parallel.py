"""Tensor parallelism inside one worker: the target's weights sharded over N ranks (processes).

Megatron-style: q/k/v and gate/up are column-parallel (each rank owns whole heads and a slice
of the MLP), o and down are row-parallel (partial sums, all-reduced), the LM head is
vocabulary-parallel (logit slices, all-gathered). The residual stream stays replicated, so the
EAGLE3 features and the draft (unsharded, on rank 0 only, as vLLM requires) see the full
hidden states. Each rank keeps its kv heads' KV cache.

Rank 0 drives: it runs the engine and, before every forward, broadcasts the batch's chunks to
the other ranks, which only run forwards (`ModelRunner.follow`). gloo on CPU, NCCL on CUDA.
"""

import multiprocessing
import os
import socket
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from engine.config import EngineConfig, ModelConfig, check_divisible


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
            else:
                out[name] = w
        return out

    def vocab_slice(self, vocab_size: int) -> slice:
        n = vocab_size // self.size
        return slice(self.rank * n, (self.rank + 1) * n)


def init_group(rank: int, size: int, port: int, device: str) -> TensorParallel:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size)
    return TensorParallel(rank, size)


def start_tensor_parallel(config: EngineConfig, model: ModelConfig) -> tuple[TensorParallel, list]:
    """For rank 0: start ranks 1..N-1 in their own processes and join the group with them."""
    size = config.tensor_parallel_size
    if size == 1:
        return TensorParallel(), []
    check_divisible(model, size)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    followers = [ctx.Process(target=_follow, args=(config, rank, size, port), daemon=True) for rank in range(1, size)]
    for process in followers:
        process.start()
    return _join(config, 0, size, port), followers


def _join(config: EngineConfig, rank: int, size: int, port: int) -> TensorParallel:
    if config.device == "cuda":
        torch.cuda.set_device(rank)  # rank i drives the i-th visible GPU
    return init_group(rank, size, port, config.device)


def _follow(config: EngineConfig, rank: int, size: int, port: int) -> None:
    from engine.runner import ModelRunner  # the runner builds on this module

    ModelRunner(config, _join(config, rank, size, port)).follow()
