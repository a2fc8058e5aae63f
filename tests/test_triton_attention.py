"""Triton paged attention against the torch reference, run on CPU by the Triton interpreter.

TRITON_INTERPRET must be set before triton is first imported, and other tests in the session may
already have imported it, so the comparison runs in a subprocess: this file executed as a script
(`python -m tests.test_triton_attention`) runs every case and prints the errors as JSON; the
pytest side runs it once and asserts per case.
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (name, heads, kv_heads, head_dim, block_size, dtype[:cache dtype], batch)
# batch: (query_len, context_len) per sequence. "mixed": a 20-token chunk after a 20-token cached
# prefix, a fresh 17-token prefill, three decodes (one at context 1), and a 6-token verification
# span at positions 13..18 that crosses a block boundary for block sizes 8 and 16.
MIXED = [(20, 40), (17, 17), (1, 1), (1, 9), (1, 33), (6, 19)]
DECODE = [(1, 5), (1, 16), (1, 17), (1, 30)]
# A third element makes the span a tree with these draft parents (span masks, engine/attention.py).
TREES = [(20, 40), (1, 9), (7, 30, [-1, 0, 0, 1, -1, 4]), (6, 19), (16, 50, [-1, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, -1, 11, 0, 6])]
CASES = [
    ("trees-gqa-d32-bs8-fp32", 6, 2, 32, 8, "float32", TREES),
    ("trees-gqa-d64-bs16-fp16", 6, 2, 64, 16, "float16", TREES),
    ("gqa-d32-bs16-fp32", 6, 2, 32, 16, "float32", MIXED),
    ("gqa-d32-bs24-fp32", 6, 2, 32, 24, "float32", MIXED),  # block_size is not held to powers of two
    ("gqa-d64-bs8-fp32", 6, 2, 64, 8, "float32", MIXED),
    ("mha-d32-bs8-fp32-decode", 4, 4, 32, 8, "float32", DECODE),
    ("gqa-d32-bs8-fp16", 6, 2, 32, 8, "float16", MIXED),
    ("gqa-d64-bs16-fp16", 6, 2, 64, 16, "float16", MIXED),
    ("trees-gqa-d64-bs16-fp32-bf16-cache", 6, 2, 64, 16, "float32:bfloat16", TREES),  # engine.kv_cache_dtype
    # A NaN query whose bf16 rounding would carry into zero unless caught (the NaN a GPU's fp32 ops give)
    ("nan-query-gqa-d64-bs16-fp32-bf16-cache", 6, 2, 64, 16, "float32:bfloat16", DECODE, True),
]
# fp16: outputs (|x| < 8, half an ulp <= 2e-3) and the probabilities fed to P @ V are rounded to fp16.
TOLERANCE = {"float32": 1e-4, "float16": 5e-3}


def _run_case(heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: str,
              batch: list[tuple[int, int]], nan_query: bool = False, *, seed: int) -> float:
    """The largest difference from the torch reference (inf where their NaN outputs differ)."""
    import torch

    from engine.attention import AttentionMetadata, paged_attention
    from engine.batch import tree_layout
    from engine.triton_attention import triton_paged_attention

    rng = random.Random(seed)
    torch.manual_seed(seed)
    needed = [-(-ctx // block_size) + 1 for _, ctx, *_ in batch]  # one spare block past the context
    num_blocks = sum(needed) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)  # non-contiguous, unordered block tables
    tables = []
    for n in needed:
        tables.append(ids[:n])
        ids = ids[n:]

    # The whole cache is random, so reading any slot past a context or outside a table shows up.
    num_layers, layer = 2, 1
    dtype, _, cache_dtype = dtype.partition(":")
    cache = torch.randn(num_blocks, num_layers, 2, block_size, kv_heads, head_dim).to(getattr(torch, cache_dtype or dtype))
    layer_cache = cache[:, layer]
    assert not layer_cache.is_contiguous()

    query_lens = [n for n, *_ in batch]
    context_lens = [ctx for _, ctx, *_ in batch]
    slots = [tables[b][pos // block_size] * block_size + pos % block_size
             for b, (n, ctx, *_) in enumerate(batch) for pos in range(ctx - n, ctx)]
    masks = [m for n, _, *tree in batch for m in (tree_layout(tree[0])[1] if tree else [-1] * n)]
    meta = AttentionMetadata.build(query_lens, context_lens, tables, slots, block_size,
                                   torch.device("cpu"), masks if any(len(b) == 3 for b in batch) else None)
    q = torch.randn(sum(query_lens), heads, head_dim).to(getattr(torch, dtype))
    if nan_query:
        q[0, 0, 0] = torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32)
    scale = head_dim ** -0.5

    # Reference in fp32 on the same (possibly fp16-rounded) inputs; a bf16 cache as the engine holds
    # it (fp32 queries on it are rounded to bf16 too).
    expected = paged_attention(q.float(), layer_cache if cache_dtype == "bfloat16" else layer_cache.float(), meta, scale)
    got = triton_paged_attention(q, layer_cache, meta, scale)
    assert got.shape == expected.shape and got.dtype == q.dtype
    if not torch.equal(got.isnan(), expected.isnan()):
        return float("inf")
    return (got.float() - expected).nan_to_num(0.0).abs().max().item()


def _main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    results = {}
    for i, (name, *args) in enumerate(CASES):
        try:
            results[name] = {"max_err": _run_case(*args, seed=i)}
        except Exception as e:  # report per case so one failure does not hide the others
            results[name] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(results))


@pytest.fixture(scope="module")
def results() -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_triton_attention"],
        cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_torch_reference(results: dict, case) -> None:
    name, dtype = case[0], case[5].partition(":")[0]
    result = results[name]
    assert "error" not in result, result.get("error")
    assert result["max_err"] < TOLERANCE[dtype], f"{name}: max abs error {result['max_err']:.2e}"


def test_a_head_dim_the_kernel_cannot_take_is_refused_at_load(model_dir) -> None:
    """It passed the load and failed every step's forward (an assert in the kernel's launcher)."""
    from dataclasses import replace

    import torch

    from engine.config import ModelConfig, ModelConfigError
    from engine.model import attention_for

    config = replace(ModelConfig.from_dir(model_dir), head_dim=80)
    with pytest.raises(ModelConfigError, match="head_dim 80: the CUDA attention kernel takes 16, 32, 64, 128"):
        attention_for(config, torch.device("cuda"), torch.bfloat16, 16)


if __name__ == "__main__":
    _main()
