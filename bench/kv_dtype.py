"""Decode throughput with an fp32 and a bf16 KV cache (`engine.kv_cache_dtype`), the two engines
taking turns on every round and batch size (in alternating order) so the machine's drift hits
both alike. Per batch size: each cache's tokens/s per round and the median of bf16 over fp32.
Same workload as `bench.engine`'s decode figures (128 new tokens after a 256-token prompt, EOS
ignored). Prints one JSON object, then a table.

    python -m bench.kv_dtype [--batches 1 4 16] [--rounds 3] [--quantization auto]
"""

import argparse
import json
import statistics

import torch

from bench.engine import ours_decode
from engine import cpu_kernels
from engine.config import EngineConfig
from engine.engine import Engine

DTYPES = ("float32", "bfloat16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", choices=["auto", "exact", "none"], default="auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engines = {kv: Engine(EngineConfig(num_kv_blocks=1024, max_num_seqs=max(args.batches), kv_cache_dtype=kv,
                                       quantization=args.quantization)) for kv in DTYPES}
    tok_s = {kv: {b: [] for b in args.batches} for kv in DTYPES}
    for rnd in range(args.rounds):
        for b in args.batches:
            for kv in DTYPES[:: 1 if rnd % 2 == 0 else -1]:
                tok_s[kv][b].append(round(ours_decode(engines[kv], b)[0], 1))
    ratio = {b: round(statistics.median(h / f for f, h in zip(tok_s["float32"][b], tok_s["bfloat16"][b])), 3)
             for b in args.batches}
    print(json.dumps({"isa": cpu_kernels.selected_isa(), "threads": args.threads, "quantization": args.quantization,
                      "tokens_per_s": tok_s, "bf16_over_fp32": ratio}))
    print("\n| batch | fp32 KV tok/s | bf16 KV tok/s | bf16 / fp32 (median) |\n|---|---|---|---|")
    for b in args.batches:
        print(f"| {b} | {tok_s['float32'][b]} | {tok_s['bfloat16'][b]} | {ratio[b]:.3f} |")


if __name__ == "__main__":
    main()
