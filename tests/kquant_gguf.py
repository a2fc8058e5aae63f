"""A `Q4_K_M`-like GGUF for tests, typed as llama.cpp's quantizer types SmolLM2-135M's: ffn_down
in Q4_K (even layers) or Q6_K (odd layers); the other matrices, whose 576 columns are not in
256-blocks, in llama.cpp's fallbacks: Q5_0, and Q8_0 for attn_v in odd layers. gguf cannot
quantize to K-quants, so here is a plain min/max quantizer for each: valid blocks, not
llama.cpp's searched scales."""

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _round(x: np.ndarray) -> np.ndarray:
    return np.floor(x + 0.5)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float [rows, cols] -> uint8 [rows, cols / 256 * 144]."""
    rows, cols = w.shape
    sub = w.reshape(rows, cols // 256, 8, 32).astype(np.float32)
    low = np.minimum(sub.min(-1), 0)
    scale, mins = (sub.max(-1) - low) / 15, -low  # w ~ scale * q - min, q in 0..15
    d, dmin = scale.max(-1) / 63, mins.max(-1) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(_round(scale / np.where(d > 0, d, 1)[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(_round(mins / np.where(dmin > 0, dmin, 1)[..., None]), 0, 63).astype(np.uint8)
    step = (d[..., None] * sc)[..., None]
    q = np.clip(_round((sub + (dmin[..., None] * m)[..., None]) / np.where(step > 0, step, 1)), 0, 15).astype(np.uint8)
    packed = np.empty((rows, cols // 256, 12), np.uint8)  # ggml's get_scale_min_k4, inverted
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    q = q.reshape(rows, cols // 256, 4, 2, 32)  # runs of 64: sub-block 2j in the low nibbles, 2j + 1 high
    qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(rows, cols // 256, 128)
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed, qs], axis=-1)
    return blocks.reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float [rows, cols] -> uint8 [rows, cols / 256 * 210]."""
    rows, cols = w.shape
    sub = w.reshape(rows, cols // 256, 16, 16).astype(np.float32)
    scale = np.abs(sub).max(-1) / 31  # w ~ scale * (q - 32), q - 32 in -32..31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(_round(scale / np.where(d > 0, d, 1)[..., None]), 0, 127).astype(np.int8)
    step = (d[..., None] * sc)[..., None]
    q = (np.clip(_round(sub / np.where(step > 0, step, 1)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(rows, cols // 256, 2, 128)  # weight 128c + r of each half c
    low, high = q & 15, q >> 4
    ql = (low[..., :64] | (low[..., 64:] << 4)).reshape(rows, cols // 256, 128)
    h = high.reshape(rows, cols // 256, 2, 4, 32)
    qh = (h[..., 0, :] | (h[..., 1, :] << 2) | (h[..., 2, :] << 4) | (h[..., 3, :] << 6)).reshape(rows, cols // 256, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=-1)
    return blocks.reshape(rows, -1)


def write_k_quant_gguf(source: Path, target: Path) -> Path:
    """`source`'s metadata and tensors, its layers' matrices requantized as the module says."""
    reader = GGUFReader(source)
    writer = GGUFWriter(target, arch=reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        writer.add_key_value(key, field.contents(), vtype, sub_type=field.types[1] if vtype == GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        data, kind = tensor.data, tensor.tensor_type
        if tensor.name.startswith("blk.") and kind != GGMLQuantizationType.F32:
            odd, fp32 = int(tensor.name.split(".")[1]) % 2, dequantize(tensor.data, tensor.tensor_type)
            if tensor.name.endswith("ffn_down.weight"):
                kind = GGMLQuantizationType.Q6_K if odd else GGMLQuantizationType.Q4_K
                data = quantize_q6_k(fp32) if odd else quantize_q4_k(fp32)
            else:
                kind = GGMLQuantizationType.Q8_0 if odd and tensor.name.endswith("attn_v.weight") else GGMLQuantizationType.Q5_0
                data = quantize(fp32, kind)
        writer.add_tensor(tensor.name, np.ascontiguousarray(data),
                          raw_dtype=kind if kind not in (GGMLQuantizationType.F32,) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
