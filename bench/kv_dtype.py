"""Decode throughput with an fp32 and a bf16 KV cache (`engine.kv_cache_dtype`), the two engines
taking turns on every round and batch size (in alternating order) so the machine's drift hits
both alike. Per batch size: each cache's tokens/s per round and the median of bf16 over fp32.
Same workload as `bench.engine`'s decode figures (128 new tokens after a 256-token prompt, EOS
ignored). And what each cache does to greedy output: on --agreement held-out chat prompts (128
tokens each), how many answers are identical to the exact path's (`quantization: exact`, fp32
cache: the fp32 model's arithmetic) and where the others first differ. Prints one JSON object,
then tables.

    python -m bench.kv_dtype [--batches 1 4 16] [--rounds 3] [--quantization auto] [--agreement 40]
"""

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench.engine import ours_decode
from engine import cpu_kernels
from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from tools.evaluate import run_batch
from tools.prompts import read_prompts

PROMPTS = Path(__file__).parent / "prompts" / "chat_eval.jsonl"

DTYPES = ("float32", "bfloat16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", choices=["auto", "exact", "none"], default="auto")
    ap.add_argument("--agreement", type=int, default=40, help="chat prompts to compare greedy output on (0: none)")
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
    agreement = against_exact(engines, args.agreement) if args.agreement else {}
    for engine in engines.values():
        engine.close()
    print(json.dumps({"isa": cpu_kernels.selected_isa(), "threads": args.threads, "quantization": args.quantization,
                      "tokens_per_s": tok_s, "bf16_over_fp32": ratio, "against_exact": agreement}))
    print("\n| batch | fp32 KV tok/s | bf16 KV tok/s | bf16 / fp32 (median) |\n|---|---|---|---|")
    for b in args.batches:
        print(f"| {b} | {tok_s['float32'][b]} | {tok_s['bfloat16'][b]} | {ratio[b]:.3f} |")
    if agreement:
        print(f"\n| cache | answers identical to the exact path's (of {args.agreement}) "
              "| first difference, median token |\n|---|---|---|")
        for kv, a in agreement.items():
            print(f"| {kv} | {a['identical']} | {a['median_first_difference']} |")


def against_exact(engines: dict[str, Engine], count: int) -> dict[str, dict]:
    """Per cache: greedy answers identical to the exact path's, and the median first differing token."""
    exact = Engine(EngineConfig(quantization="exact", kv_cache_dtype="float32"))
    prompts = [exact.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in read_prompts(PROMPTS)[:count]]
    params = SamplingParams(max_tokens=128)
    first = {kv: [] for kv in engines}
    for prompt in prompts:
        reference = run_batch(exact, [prompt], params)[0][0]
        for kv, engine in engines.items():
            out = run_batch(engine, [prompt], params)[0][0]
            first[kv].append(next((i for i, (a, b) in enumerate(zip(out, reference)) if a != b),
                                  None if len(out) == len(reference) else min(len(out), len(reference))))
    exact.close()
    return {kv: {"identical": sum(d is None for d in firsts),
                 "median_first_difference": statistics.median([d for d in firsts if d is not None] or [0])}
            for kv, firsts in first.items()}


if __name__ == "__main__":
    main()
