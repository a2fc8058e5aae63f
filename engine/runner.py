"""The model runner: owns the weights and the KV cache tensors of one engine, runs forwards."""

import logging

import torch

from engine.batch import SeqChunk, build_batch
from engine.config import EngineConfig, ModelConfig
from engine.kv_layout import CacheShape, KVLayout, allocate_cache
from engine.loader import load_weights, model_fingerprint, resolve_model_dir
from engine.model import CausalLM, ForwardOutput

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.model_dir = resolve_model_dir(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        weights = load_weights(self.model_dir, config.torch_dtype, self.device)
        self.model = CausalLM(self.model_config, weights, self.max_model_len, config.block_size)
        mc = self.model_config
        self.layout = KVLayout(
            model=model_fingerprint(self.model_dir),
            dtype=config.dtype,
            block_size=config.block_size,
            target=CacheShape(mc.num_layers, mc.num_kv_heads, mc.head_dim),
            draft=None,
        )
        self.kv_cache = allocate_cache(self.layout, self.layout.target, config.num_kv_blocks, self.device)

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk], return_aux: bool = False) -> ForwardOutput:
        batch = build_batch(chunks, self.config.block_size, self.device, return_aux)
        return self.model.forward(batch, self.kv_cache)
