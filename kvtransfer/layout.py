"""KV layout on the wire (engine KVLayout <-> proto KVLayout) and byte access to cache blocks."""

import numpy as np
import torch
import xxhash

from engine.kv_layout import CacheShape, KVLayout
from proto.pdspec.v1 import kv_pb2


def layout_to_proto(layout: KVLayout) -> kv_pb2.KVLayout:
    msg = kv_pb2.KVLayout(model=layout.model, dtype=layout.dtype, block_size=layout.block_size,
                          target=_shape_to_proto(layout.target), draft_model=layout.draft_model)
    if layout.draft is not None:
        msg.draft.CopyFrom(_shape_to_proto(layout.draft))
    return msg


def layout_from_proto(msg: kv_pb2.KVLayout) -> KVLayout:
    return KVLayout(model=msg.model, dtype=msg.dtype, block_size=msg.block_size, target=_shape_from_proto(msg.target),
                    draft=_shape_from_proto(msg.draft) if msg.HasField("draft") else None, draft_model=msg.draft_model)


def _shape_to_proto(shape: CacheShape) -> kv_pb2.CacheShape:
    return kv_pb2.CacheShape(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim)


def _shape_from_proto(msg: kv_pb2.CacheShape) -> CacheShape:
    return CacheShape(num_layers=msg.num_layers, num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim)


def check_caches(layout: KVLayout, caches: dict[str, torch.Tensor]) -> None:
    """Raise ValueError unless `caches` are the block-major tensors `layout` describes.

    Transfers address block b of a cache as bytes [b * block_bytes, (b + 1) * block_bytes) from
    its data pointer, so a tensor of another shape, dtype or stride would be read or written wrongly."""
    if set(caches) != set(layout.caches()):
        raise ValueError(f"caches {sorted(caches)} do not match the layout's {sorted(layout.caches())}: "
                         "pass one tensor per cache the layout names (target, and draft with an EAGLE3 head)")
    devices = {t.device for t in caches.values()}
    if len(devices) > 1:
        raise ValueError(f"KV caches are on devices {sorted(map(str, devices))}: keep target and draft on one")
    num_blocks = {t.shape[0] for t in caches.values()}
    if len(num_blocks) > 1:
        raise ValueError(f"KV caches have different block counts {sorted(num_blocks)}: they share block ids")
    for name, shape in layout.caches().items():
        t = caches[name]
        expected = (t.shape[0], *layout.block_shape(shape))
        if tuple(t.shape) != expected or str(t.dtype) != f"torch.{layout.dtype}" or not t.is_contiguous():
            raise ValueError(f"{name} cache is {tuple(t.shape)} {t.dtype} (contiguous={t.is_contiguous()}), the layout "
                             f"needs a contiguous {expected} torch.{layout.dtype}: allocate it with allocate_cache")


def block_view(cache: torch.Tensor, block_id: int) -> torch.Tensor:
    """Block `block_id` of a block-major cache as a flat uint8 tensor sharing its memory."""
    return cache[block_id].view(-1).view(torch.uint8)


def read_block(cache: torch.Tensor, block_id: int) -> bytes:
    return block_view(cache, block_id).cpu().numpy().tobytes()


def write_block(cache: torch.Tensor, block_id: int, data: bytes) -> None:
    dst = block_view(cache, block_id)
    src = np.frombuffer(data, dtype=np.uint8)  # read-only: numpy copies from it without a tensor over it
    if dst.device.type == "cpu":
        dst.numpy()[:] = src
    else:
        dst.copy_(torch.tensor(src))


def block_checksums(caches: dict[str, torch.Tensor], names: list[str], block_ids: list[int]) -> list[int]:
    """XXH3-64 of each block, cache by cache in `names`' order, block by block (KVHandle.block_checksums);
    [] where the caches are in device memory (hashing them would copy every block out)."""
    if any(caches[name].device.type != "cpu" for name in names):
        return []
    return [xxhash.xxh3_64_intdigest(block_view(caches[name], b).numpy()) for name in names for b in block_ids]
