"""The floors this machine puts under a decode step: how fast the model could run here at best,
from the machine's measured rates and the model's sizes, to read bench.engine's and bench.peer's
figures (and a speed goal) against.

Measured (2 threads unless noted):
- DRAM reads: a plain stream (torch summing 512 MB), and the KV cache's pieces as attention
  reads them (bench.attention's read floor, `--context` positions of 16 sequences);
- the weights' reads: the same stream over a buffer of the model's weight bytes (512 MB at most),
  read again and again as the steps read the weights. Where the last-level cache holds most of
  them (BENCHMARKS' Machine F and the embedded model's 96 MB) that is ~1.8x DRAM's rate, and a
  floor priced at DRAM's stood above what the engine measures; elsewhere the two agree;
- the threads' vector units, running together, from a C probe (bench/probe.c) built with the
  kernels' compiler and the ISA flags of the kernels in use: int8 multiply-adds (what the
  quantized GEMMs are made of) and fp32 FMA lanes (attention), in independent chains (two vCPUs
  can share one core's units: then two threads get one core's rate, not twice it);
- an OpenMP region's and a barrier's cost (the kernels open ~5 regions a layer).
For the model (default the embedded one), per step of B sequences of S query tokens each over
C cached positions:
  memory  = weight bytes / their stream rate + B x C x KV bytes per position / KV read rate
  compute = B x S x weight multiply-adds / (int8 rate, or the FMA rate for matrices the
            fp32 GEMM runs) + B x S x C x attention FMAs per position / FMA rate
  floor   = the larger (both overlapped perfectly; no norms, sampling or Python)
and what the floors allow: batch B's aggregate speedup over batch 1 (B x floor(1) / floor(B)),
and a forward over S tokens' time against one token's (floor(1, S) / floor(1, 1)). The KV read
rate is measured on the embedded model's cache geometry, whatever --model is. Prints one JSON
object, then a table.

    python -m bench.floors [--context 320] [--batches 1 4 16] [--spans 6] [--kv-cache-dtype auto]
"""

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench.attention import read_floor
from bench.timing import alternated_median_ms
from engine import cpu_kernels
from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_layout import row_elements


def probe(isa: str, threads: int) -> dict[str, float]:
    """bench/probe.c's rates and costs, built for `isa` as the kernels are."""
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "probe"
        cmd = [cpu_kernels.c_compiler(), "-O3", "-fopenmp", "-std=gnu11", *cpu_kernels.isa_flags(isa),
               str(Path(__file__).with_name("probe.c")), "-o", str(exe)]
        built = subprocess.run(cmd, capture_output=True, text=True)
        if built.returncode:
            raise SystemExit(f"building bench/probe.c for {isa} failed:\n{built.stderr}")
        return json.loads(subprocess.run([str(exe), str(threads)], check=True, capture_output=True, text=True).stdout)


def stream_gb_s(nbytes: int = 2**29, reps: int = 9) -> float:
    """torch summing a buffer of nbytes (default 512 MB: from DRAM), read again each rep: the
    median rep (after two untimed: a cache that can hold the buffer fills in the first)."""
    data = torch.ones(nbytes // 4)
    times = []
    for _ in range(reps + 2):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times[2:]) / 1e9


def model_costs(engine: Engine) -> dict[str, float]:
    """Per token: weight bytes and multiply-adds (layers and lm_head; those of int8 dot products
    apart from the fp32 GEMM's); per cached position: KV bytes (every layer, keys and values) and
    attention FMAs (scores and weighted values, every head)."""
    model, config = engine.runner.model, engine.runner.model.config
    linears = [lin for layer in model.layers for lin in layer.linears] + [model.lm_head]
    kv_dtype = getattr(torch, engine.runner.cache_dtype)
    return {
        "weight_bytes": sum(lin.weight.numel() * lin.weight.element_size() for lin in linears),
        "int8_macs": sum(lin.in_features * lin.out_features for lin in linears if lin.int8_dot),
        "fp32_macs": sum(lin.in_features * lin.out_features for lin in linears if not lin.int8_dot),
        "kv_bytes_per_position": config.num_layers * 2 * config.num_kv_heads
        * row_elements(engine.runner.cache_dtype, config.head_dim) * kv_dtype.itemsize,
        "attention_fmas_per_position": config.num_layers * 2 * config.num_heads * config.head_dim,
    }


def step_floor_ms(costs: dict, rates: dict, batch: int, span: int, context: int) -> dict[str, float]:
    rows = batch * span
    memory = costs["weight_bytes"] / rates["weights_gb_s"] / 1e6 \
        + batch * context * costs["kv_bytes_per_position"] / rates["kv_read_gb_s"] / 1e6
    fmas = costs["fp32_macs"] + context * costs["attention_fmas_per_position"]
    compute = rows * (costs["int8_macs"] / rates["int8_macs_per_ns"] + fmas / rates["fma_lanes_per_ns"]) / 1e6
    return {"memory_ms": memory, "compute_ms": compute, "floor_ms": max(memory, compute)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=320, help="cached positions per sequence")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--spans", type=int, nargs="+", default=[6], help="query tokens of a verification forward")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16", "int8"], default="auto",
                    help="engine.kv_cache_dtype (auto: the engine's default for this model and quantization)")
    args = ap.parse_args()
    if args.context < 1:
        ap.error("--context: at least 1 cached position (the KV read rate is measured over them)")
    torch.set_num_threads(args.threads)
    isa = cpu_kernels.selected_isa()
    engine = Engine(EngineConfig(model=args.model, num_threads=args.threads, kv_cache_dtype=args.kv_cache_dtype))
    costs = model_costs(engine)
    read, read_bytes = read_floor(16, args.context, getattr(torch, engine.runner.cache_dtype))
    read_ms = alternated_median_ms({"read": read}, reps=15, warmup=3)["read"]
    rates = {**probe(isa, args.threads), "stream_gb_s": stream_gb_s(),
             "weights_gb_s": stream_gb_s(min(int(costs["weight_bytes"]), 2**29)), "kv_read_gb_s": read_bytes / read_ms / 1e6}
    one = step_floor_ms(costs, rates, 1, 1, args.context)["floor_ms"]
    steps = {}
    for b in args.batches:
        steps[f"batch {b}"] = floor = step_floor_ms(costs, rates, b, 1, args.context)
        floor["speedup_over_batch_1"] = b * one / floor["floor_ms"]
    for span in args.spans:
        steps[f"{span} tokens"] = floor = step_floor_ms(costs, rates, 1, span, args.context)
        floor["time_over_one_token"] = floor["floor_ms"] / one
    print(json.dumps({"isa": isa, "threads": args.threads, "context": args.context,
                      "kv_cache_dtype": engine.runner.cache_dtype, "rates": rates, "model": costs,
                      "steps": {k: {n: round(v, 3) for n, v in s.items()} for k, s in steps.items()}}))
    print(f"{isa}, {args.threads} threads: int8 {rates['int8_macs_per_ns']:.0f} MAC/ns and fp32 "
          f"{rates['fma_lanes_per_ns']:.0f} FMA/ns together (one thread alone: "
          f"{rates['int8_macs_per_ns_one_thread']:.0f} and {rates['fma_lanes_per_ns_one_thread']:.0f}); stream {rates['stream_gb_s']:.1f} GB/s (over the weights' {costs['weight_bytes'] / 1e6:.0f} MB: "
          f"{rates['weights_gb_s']:.1f}), KV pieces "
          f"{rates['kv_read_gb_s']:.1f} GB/s; OpenMP region {rates['region_us']:.2f} us, barrier "
          f"{rates['barrier_us']:.2f} us")
    print(f"{'step':12}{'memory ms':>11}{'compute ms':>12}{'floor ms':>10}  at best: batch's speedup over batch 1, "
          "span's time over one token")
    for name, s in steps.items():
        best = s.get("speedup_over_batch_1", s.get("time_over_one_token"))
        print(f"{name:12}{s['memory_ms']:>11.2f}{s['compute_ms']:>12.2f}{s['floor_ms']:>10.2f}  {best:.2f}")


if __name__ == "__main__":
    main()
