"""The model runner: owns the weights and KV cache tensors of one engine (target, and the EAGLE3
draft when configured), and runs their forwards; with tensor parallelism it also starts the
other ranks' processes and drives them (engine/parallel.py has the sharding math)."""

import multiprocessing
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from engine.batch import SeqChunk, build_batch
from engine.config import EngineConfig, ModelConfig, ModelConfigError, check_divisible
from engine.inference import inference
from engine.spec.eagle3_model import DraftOutput, Eagle3Config, Eagle3Draft
from engine.kv_layout import CacheShape, KVLayout, allocate_cache
from engine.loader import load_weights
from engine.quant import QuantizedTensor, quantize_matrices
from engine.model_dir import model_fingerprint, model_name, resolve_model_dir
from engine.model import CausalLM, ForwardOutput
from engine.parallel import TensorParallel
from engine.procfs import exit_with_parent

# The EAGLE3 head this project trained for the embedded default model (see its MODEL_CARD.md).
EMBEDDED_DRAFT_DIR = Path(__file__).parent / "spec" / "eagle3_heads" / "SmolLM2-135M-Instruct-eagle3"


class ModelRunner:
    """With tensor_parallel_size N > 1, the runner created by the engine is rank 0: it starts
    ranks 1..N-1 (`follow` in their own processes) and broadcasts every forward and KV move to them."""

    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype: torch.dtype = getattr(torch, config.dtype)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.model_dir = resolve_model_dir(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self._followers = []
        if tp is None:
            tp, self._followers = start_tensor_parallel(config, self.model_config)
        self.tp = tp
        blocks = {"auto": "int8", "int8": "int8", "exact": "exact"}.get(config.quantization)
        blocks = blocks if self.device.type == "cpu" else None
        weights = load_weights(self.model_dir, self.dtype, self.device, blocks=blocks)
        if config.quantization == "int8":
            weights = quantize_matrices(weights)
        weights = tp.shard(self.model_config, weights)
        quantized = any(isinstance(w, QuantizedTensor) for w in weights.values())
        self.cache_dtype = config.cache_dtype(int8_activations=quantized and blocks == "int8")
        self.model = CausalLM(self.model_config, weights, self.max_model_len, config.block_size, tp)
        is_driver = tp.rank == 0
        self.draft, draft_model = (self._load_draft() if config.speculative.method == "eagle3" and is_driver
                                   else (None, ""))
        mc = tp.local_config(self.model_config)
        self.layout = KVLayout(
            # With what changes the KV they compute: the activations' dtype, and quantized weights' mode
            # (auto runs a file's other types as floats, int8 as Q8_0; floats compute other KV again).
            model=f"{model_fingerprint(self.model_dir, model_name(config.model))}/{config.dtype}"
                  + (f"+{config.quantization}" if quantized else ""),
            dtype=self.cache_dtype,
            block_size=config.block_size,
            target=CacheShape(mc.num_layers, mc.num_kv_heads, mc.head_dim),
            draft=CacheShape(1, self.draft.config.layer.num_kv_heads, self.draft.config.layer.head_dim)
            if self.draft else None,
            draft_model=draft_model,
        )
        self.kv_cache = allocate_cache(self.layout, self.layout.target, config.num_kv_blocks, self.device)
        self.draft_cache = (allocate_cache(self.layout, self.layout.draft, config.num_kv_blocks, self.device)
                            if self.draft else None)

    @inference
    def forward(self, chunks: list[SeqChunk], return_aux: bool = False) -> ForwardOutput:
        if self.tp.size > 1:
            self.tp.broadcast(("forward", chunks, return_aux))
        batch = build_batch(chunks, self.config.block_size, self.device, return_aux)
        return self.model.forward(batch, self.kv_cache)

    @inference
    def move_kv(self, block_table: list[int], src: list[int], dst: list[int]) -> None:
        """Copy one sequence's target KV (every layer) from positions src to positions dst: an
        accepted tree path into consecutive slots. dst[i] < src[i], both increasing, so copying all
        at once never reads a slot it already wrote."""
        if self.tp.size > 1:
            self.tp.broadcast(("move_kv", block_table, src, dst))
        self._move_kv(block_table, src, dst)

    def _move_kv(self, block_table: list[int], src: list[int], dst: list[int]) -> None:
        bs = self.config.block_size
        table = torch.tensor(block_table, device=self.device)
        src_t, dst_t = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        self.kv_cache[table[dst_t // bs], :, :, dst_t % bs] = self.kv_cache[table[src_t // bs], :, :, src_t % bs]

    @inference
    def follow(self) -> None:
        """Ranks > 0: run every forward and KV move rank 0 broadcasts, until it says stop."""
        while (message := self.tp.broadcast(None)) is not None:
            kind, *args = message
            if kind == "forward":
                chunks, return_aux = args
                self.model.forward(build_batch(chunks, self.config.block_size, self.device, return_aux), self.kv_cache)
            else:
                self._move_kv(*args)

    def close(self) -> None:
        """Stop the other ranks (rank 0 only); a no-op without tensor parallelism."""
        if self._followers:
            self.tp.broadcast(None)
            for process in self._followers:
                process.join(timeout=30)
            self._followers = []
            torch.distributed.destroy_process_group()

    @inference
    def forward_draft(self, chunks: list[SeqChunk], hidden: torch.Tensor) -> DraftOutput:
        """chunks carry the token *after* each position (see Eagle3Draft.forward)."""
        batch = build_batch(chunks, self.config.block_size, self.device)
        return self.draft.forward(batch, hidden, self.draft_cache)

    @inference
    def write_draft_kv(self, chunks: list[SeqChunk], hidden: torch.Tensor) -> None:
        """Only the draft cache's entries that `forward_draft` would write (see Eagle3Draft.write_kv)."""
        self.draft.write_kv(build_batch(chunks, self.config.block_size, self.device), hidden, self.draft_cache)

    def _load_draft(self) -> tuple[Eagle3Draft, str]:
        """The EAGLE3 head and its identity in the KV layout."""
        spec = self.config.speculative  # EngineConfig asks for spec.model where the target is not the embedded one
        draft_dir = Path(spec.model) if spec.model else EMBEDDED_DRAFT_DIR
        if not draft_dir.is_dir():
            raise ModelConfigError(f"speculative.model: EAGLE3 draft directory {draft_dir} does not exist")
        draft_config = Eagle3Config.from_dir(draft_dir)
        mc = self.model_config
        if draft_config.target_hidden_size != mc.hidden_size:
            raise ModelConfigError(
                f"speculative.model: draft {draft_dir} expects a target hidden size of "
                f"{draft_config.target_hidden_size}, the target has {mc.hidden_size}"
            )
        if draft_config.aux_layer_ids is not None:
            try:
                self.model.aux_layer_ids = mc.check_aux_layer_ids(draft_config.aux_layer_ids)
            except ValueError as e:
                raise ModelConfigError(f"speculative.model: draft {draft_dir}: {e}") from None
        weights = load_weights(draft_dir, self.dtype, self.device)
        int8 = self.config.quantization in ("auto", "int8") and self.device.type == "cpu" and self.dtype == torch.float32
        draft = Eagle3Draft(draft_config, weights, self.model.embed_tokens, self.max_model_len, self.config.block_size,
                            int8=int8)
        return draft, f"{model_fingerprint(draft_dir, draft_dir.name)}/{self.config.dtype}" + ("+int8" if int8 else "")


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
    followers = [ctx.Process(target=_follow, args=(config, rank, size, port, os.getpid()), daemon=True)
                 for rank in range(1, size)]
    for process in followers:
        process.start()
    return _join(config, 0, size, port), followers


def _join(config: EngineConfig, rank: int, size: int, port: int) -> TensorParallel:
    if config.device == "cuda":
        torch.cuda.set_device(rank)  # rank i drives the i-th visible GPU
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("nccl" if config.device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size)
    return TensorParallel(rank, size)


def _follow(config: EngineConfig, rank: int, size: int, port: int, leader_pid: int) -> None:
    # A leader killed outright (SIGKILL, the OOM killer) runs no cleanup: without this a follower
    # would wait in its next collective until NCCL's watchdog fires, holding its GPU's memory.
    exit_with_parent(leader_pid)
    ModelRunner(config, _join(config, rank, size, port)).follow()
