"""Load a model directory's weights (HF safetensors layout, single file or sharded), and a
converted GGUF's block-quantized tensors as they are stored."""

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from engine.model_dir import weight_files
from engine.quant import BLOCK_BYTES, BLOCK_WEIGHTS, BLOCKS_FILE, Q4_0_MAX_SCALE, QuantizedTensor, fits_kernels

log = logging.getLogger(__name__)


def load_weights(model_dir: Path, dtype: torch.dtype, device: torch.device, prefix: str = "",
                 blocks: Literal["exact", "int8"] | None = None) -> dict[str, "torch.Tensor | QuantizedTensor"]:
    """All tensors whose name starts with `prefix` on device; floating-point ones cast to dtype.
    blocks: the tensors a converted GGUF keeps as blocks come as QuantizedTensor instead, to be
    multiplied exactly or with int8 activations (see QuantizedTensor)."""
    kept = _load_blocks(model_dir, prefix, device, blocks == "int8") if blocks else {}
    weights: dict[str, torch.Tensor | QuantizedTensor] = {}
    for f in weight_files(model_dir):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                if name.startswith(prefix) and name not in kept:
                    tensor = fh.get_tensor(name)
                    weights[name] = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)
    return weights | kept


def _load_blocks(model_dir: Path, prefix: str, device: torch.device, int8_dot: bool) -> dict[str, QuantizedTensor]:
    path = model_dir / BLOCKS_FILE
    if not path.is_file():
        return {}
    with safe_open(str(path), framework="pt") as fh:
        qtypes: dict[str, str] = json.loads((fh.metadata() or {}).get("qtypes", "{}"))
        blocks = {}
        for name in fh.keys():
            if name.startswith(prefix):
                data = fh.get_tensor(name).to(device)
                cols = data.shape[1] // BLOCK_BYTES[qtypes[name]] * BLOCK_WEIGHTS[qtypes[name]]
                blocks[name] = QuantizedTensor(qtypes[name], data, cols, int8_dot)
    unfit = sorted(name for name, w in blocks.items() if not fits_kernels(w))
    dequantized = Counter(kind for name, kind in qtypes.items() if name.startswith(prefix) and name not in blocks)
    if dequantized:
        log.info("%s: running %s dequantized (no kernel for these types)", model_dir.name,
                 ", ".join(f"{n} {kind} tensors" for kind, n in sorted(dequantized.items())))
    if unfit:
        log.info("%s: running %d Q4_0 tensors dequantized, their scales beyond %g (the Q4 kernels' fp16 min "
                 "overflows): %s", model_dir.name, len(unfit), Q4_0_MAX_SCALE, ", ".join(unfit))
    return {name: w for name, w in blocks.items() if name not in unfit}

