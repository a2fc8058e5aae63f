"""Decode throughput with each KV cache type (`engine.kv_cache_dtype`: fp32, bf16, int8), the
engines taking turns on every round and batch size (in alternating order) so the machine's drift
hits all alike. Per batch size: each cache's tokens/s per round and the median of each over the
first type's.
Same workload as `bench.engine`'s decode figures (128 new tokens after a 256-token prompt, EOS
ignored). And what each cache does to greedy output: on --agreement held-out chat prompts (128
tokens each), how many answers are identical to the exact path's (`quantization: exact`, fp32
cache: the fp32 model's arithmetic) and where the others first differ. Prints one JSON object,
then tables.

    python -m bench.kv_dtype [--dtypes float32 bfloat16 int8] [--batches 1 4 16] [--rounds 3]
                             [--quantization auto] [--agreement 40]
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


@torch.inference_mode()  # held as the engine loop's thread holds it: no step enters it (engine/inference.py)
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "int8"],
                    default=["float32", "bfloat16", "int8"], help="cache types; ratios are over the first")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", choices=["auto", "exact", "none"], default="auto")
    ap.add_argument("--agreement", type=int, default=40, help="chat prompts to compare greedy output on (0: none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engines = {kv: Engine(EngineConfig(num_kv_blocks=1024, max_num_seqs=max(args.batches), kv_cache_dtype=kv,
                                       quantization=args.quantization)) for kv in args.dtypes}
    tok_s = {kv: {b: [] for b in args.batches} for kv in args.dtypes}
    for rnd in range(args.rounds):
        for b in args.batches:
            for kv in args.dtypes[:: 1 if rnd % 2 == 0 else -1]:
                tok_s[kv][b].append(round(ours_decode(engines[kv], b)[0], 1))
    base = args.dtypes[0]
    ratio = {kv: {b: round(statistics.median(t / f for f, t in zip(tok_s[base][b], tok_s[kv][b])), 3)
                  for b in args.batches} for kv in args.dtypes[1:]}
    agreement = against_exact(engines, args.agreement) if args.agreement else {}
    for engine in engines.values():
        engine.close()
    print(json.dumps({"isa": cpu_kernels.selected_isa(), "threads": args.threads, "quantization": args.quantization,
                      "tokens_per_s": tok_s, f"over_{base}": ratio, "against_exact": agreement}))
    header = ["batch", *(f"{kv} KV tok/s" for kv in args.dtypes), *(f"{kv} / {base} (median)" for kv in ratio)]
    print("\n| " + " | ".join(header) + " |\n" + "|---" * len(header) + "|")
    for b in args.batches:
        cells = [str(b), *(str(tok_s[kv][b]) for kv in args.dtypes), *(f"{ratio[kv][b]:.3f}" for kv in ratio)]
        print("| " + " | ".join(cells) + " |")
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
