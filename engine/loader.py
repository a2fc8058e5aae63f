"""Load a model directory's weights (HF safetensors layout, single file or sharded)."""

from pathlib import Path

import torch
from safetensors import safe_open

from engine.model_dir import weight_files


def load_weights(model_dir: Path, dtype: torch.dtype, device: torch.device, prefix: str = "") -> dict[str, torch.Tensor]:
    """All tensors whose name starts with `prefix` on device; floating-point ones cast to dtype."""
    weights = {}
    for f in weight_files(model_dir):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                if name.startswith(prefix):
                    tensor = fh.get_tensor(name)
                    weights[name] = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)
    return weights

