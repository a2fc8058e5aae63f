"""What sampling costs a batched decode step: one engine decodes a batch of chat prompts with each
sampling setting, its steps taking turns between the native CPU sampling (csrc/logit_rows.c: the
distribution and the inverse-CDF draw) and the torch reference (`reference_probabilities`, a copy
of each row and torch's inverse CDF), so the machine's drift hits both alike. Per setting: each
path's median step time over the steps where the whole batch decodes, and greedy's for scale.
Prints one JSON object, then a table.

    python -m bench.sampling [--batch-size 16] [--max-tokens 96] [--threads 2]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import engine.spec.rejection as rejection
from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from engine.sampling import probabilities, reference_probabilities
from tools.prompts import read_prompts

PROMPTS = Path(__file__).parent / "prompts" / "chat_eval.jsonl"
SETTINGS = {"greedy": {}, "temperature 1.0": {"temperature": 1.0}, "top-p 0.9, T 0.7": {"temperature": 0.7, "top_p": 0.9},
            "top-k 40, T 0.8": {"temperature": 0.8, "top_k": 40}}


PATHS = {"native": (probabilities, rejection._draw_rows),
         "torch": (reference_probabilities, rejection.reference_draw_rows)}


def step_times(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[float]]:
    """Each path's step times while the whole batch decodes, the paths taking turns step by step."""
    for prompt in prompts:
        engine.add_request(prompt, params)
    times, step = {name: [] for name in PATHS}, 0
    try:
        while engine.has_unfinished():
            name = list(PATHS)[step % len(PATHS)]
            rejection.probabilities, rejection._draw_rows = PATHS[name]
            full = len(engine.scheduler.running) == len(prompts)
            start = time.perf_counter()
            engine.step()
            if full and step > 2 and len(engine.scheduler.running) == len(prompts):
                times[name].append(time.perf_counter() - start)
            step += 1
    finally:
        rejection.probabilities, rejection._draw_rows = PATHS["native"]
    return times


@torch.inference_mode()  # held as the engine loop's thread holds it: no step enters it (engine/inference.py)
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(max_num_seqs=args.batch_size, num_threads=args.threads))
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": p}])
               for p in read_prompts(PROMPTS)[: args.batch_size]]
    result = {"batch_size": len(prompts), "max_tokens": args.max_tokens, "step_ms": {}}
    for name, setting in SETTINGS.items():
        times = step_times(engine, prompts, SamplingParams(max_tokens=args.max_tokens, seed=1, **setting))
        result["step_ms"][name] = {path: round(statistics.median(t) * 1e3, 2) for path, t in times.items() if t}
    print(json.dumps(result))
    print(f"\n{'ms a step, batch ' + str(len(prompts)):24s} {'native':>8s} {'torch':>8s}")
    for name, ms in result["step_ms"].items():
        print(f"{name:24s} {ms.get('native', float('nan')):8.2f} {ms.get('torch', float('nan')):8.2f}")


if __name__ == "__main__":
    main()
