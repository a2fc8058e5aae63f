"""Paged attention alone: a decode step's attention over every layer, with its keys and values in
DRAM (cold) or all in cache (hot), against the time a plain read of the same bytes takes.

The embedded model's attention shape (30 layers, 9 heads over 3 KV heads of 64), `--span` query
tokens per sequence (1: a decode step; more: a speculative verification span, the last `span` of
the `--context` positions), `--context` cached positions each, blocks scattered over the pool as
a long-running server leaves them. Cold: every sequence has blocks of its own (batch x context x
1536 bytes a layer with an fp32 cache, 768 bf16, 408 int8). Hot: every sequence reads the same blocks of one layer (they stay in L2), so the time is
the kernel's arithmetic. Read floor: torch summing the same per-layer slices of the cache (the
bytes cold attention reads, in the same pieces). The cache types take turns in every round (cold,
hot and reads each), so the host's drift hits all alike. Prints one JSON object, then a table.

    python -m bench.attention [--batches 1 4 16] [--context 320] [--span 1] [--threads 2]
                              [--dtypes float32 bfloat16 int8]
"""

import argparse
import json
from typing import Callable

import torch

from bench.timing import alternated_median_ms
from engine import cpu_kernels
from engine.kv_layout import encode_rows

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
REPS = 15


def attention_step(kernels: cpu_kernels.CpuKernels, batch: int, context: int, span: int, dtype: torch.dtype,
                   hot: bool = False) -> tuple[Callable[[], None], torch.Tensor]:
    """One step's attention over all layers with `kernels` (inputs seeded, so two builds given
    the same arguments read the same data), and the tensor its output lands in."""
    per_seq, rng = -(-context // BLOCK), torch.Generator().manual_seed(0)
    pool = per_seq if hot else batch * per_seq
    cache = encode_rows(torch.randn(pool, 1 if hot else LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=rng), dtype)
    tables = (torch.arange(per_seq).repeat(batch, 1) if hot
              else torch.randperm(pool, generator=rng).view(batch, per_seq)).long()
    q, out = torch.randn(batch * span, HEADS, HEAD_DIM, generator=rng), torch.empty(batch * span, HEADS * HEAD_DIM)
    starts = torch.arange(0, batch * span + 1, span, dtype=torch.int32)
    lengths = torch.full((batch,), context, dtype=torch.int32)

    def step() -> None:
        for layer in range(LAYERS):
            kernels.paged_attention(q, cache[:, 0 if hot else layer], tables, starts, lengths, HEAD_DIM**-0.5, out)
    return step, out


def read_floor(batch: int, context: int, dtype: torch.dtype) -> tuple[Callable[[], None], int]:
    """A read of the KV pieces cold attention reads (whole blocks), and how many bytes they are."""
    # the same bytes summed as fp32 (torch's bf16 sum is slower than the read)
    cache = encode_rows(torch.randn(batch * -(-context // BLOCK), LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM), dtype)
    cache = cache.view(torch.float32)
    return lambda: [cache[:, layer].sum() for layer in range(LAYERS)], cache.numel() * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--context", type=int, default=320)
    parser.add_argument("--span", type=int, default=1, help="query tokens per sequence")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "int8"],
                        default=["float32", "bfloat16", "int8"], help="KV cache element types")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = {}
    kernels = cpu_kernels.kernels()
    for batch in args.batches:
        dtypes = {name: getattr(torch, name) for name in args.dtypes}
        cold, hot = ({name: attention_step(kernels, batch, args.context, args.span, dtype, is_hot)[0]
                      for name, dtype in dtypes.items()} for is_hot in (False, True))
        reads = {name: read_floor(batch, args.context, dtype) for name, dtype in dtypes.items()}
        cold, hot = (alternated_median_ms(calls, REPS, warmup=3) for calls in (cold, hot))
        floor = alternated_median_ms({name: read for name, (read, _) in reads.items()}, REPS, warmup=3)
        for name in dtypes:
            megabytes = reads[name][1] * args.context / (-(-args.context // BLOCK) * BLOCK) / 1e6  # the positions' own
            rows[f"b{batch} {name}"] = {
                "megabytes": round(megabytes, 1), "cold_ms": round(cold[name], 2), "hot_ms": round(hot[name], 2),
                "read_floor_ms": round(floor[name], 2), "cold_gb_s": round(megabytes / cold[name], 1)}
    print(json.dumps({"isa": cpu_kernels.selected_isa(), "threads": args.threads, "context": args.context,
                      "span": args.span, "rows": rows}))
    print(f"{'':16}{'MB':>8}{'cold ms':>10}{'hot ms':>10}{'read ms':>10}{'cold GB/s':>11}")
    for name, r in rows.items():
        print(f"{name:16}{r['megabytes']:>8}{r['cold_ms']:>10}{r['hot_ms']:>10}{r['read_floor_ms']:>10}{r['cold_gb_s']:>11}")


if __name__ == "__main__":
    main()
