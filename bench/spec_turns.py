"""Speculative settings against each other: plain decoding and EAGLE3 with each `draft_top_k`
(a chain, then trees with more leaves per position), each `draft_tree_width` (`--tree-width`,
EAGLE-2's dynamic tree), `num_speculative_tokens` and `draft_confidence_threshold` (`--threshold`),
each with or without the prompt-lookup branch (`--lookup-branch`) and the governor (`--adaptive`),
for each head given (`--draft`), in one process, the engines taking
turns on every prompt batch (in alternating order) so the machine's drift hits all alike. Per setting:
tokens/s, and its time per batch against the others' as a median of per-batch ratios, a
paired figure steadier than a ratio of two runs' speeds. Greedy; every output must be
token-identical to plain decoding. Prints one JSON object, then a table.

    python -m bench.spec_turns [--prompts bench/prompts/chat_eval.jsonl] [--max-prompts 40]
        [--batch-size 1] [--top-k 1 4] [--tree-width 1] [--num-speculative-tokens 5] [--threshold priced|P ...]
        [--disable-by-batch-size 2] [--lookup-branch off|on|both] [--prompt-lookup-min 2] [--adaptive on|off|both]
        [--draft HEAD_DIR ...]

K, the threshold and the batch limit default to what the engine gives eagle3 on CPU (the threshold: priced
by each engine from its verification rows' cost, its last value in the JSON).
"""

import argparse
import json
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from engine.config import EAGLE3_DEFAULTS, EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from tools.evaluate import run_batch, warm_up
from tools.prompts import read_prompts
from engine.stats import AcceptanceStats


@torch.inference_mode()  # held as the engine loop's thread holds it: no step enters it (engine/inference.py)
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=Path, default=Path(__file__).parent / "prompts" / "chat_eval.jsonl")
    p.add_argument("--max-prompts", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--top-k", type=int, nargs="+", default=[1, 4])
    p.add_argument("--tree-width", type=int, nargs="+", default=[1], help="draft_tree_width values")
    cpu = EAGLE3_DEFAULTS["cpu"]  # the settings the engine gives eagle3 on this device
    p.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[cpu["num_speculative_tokens"]])
    p.add_argument("--threshold", type=lambda v: None if v == "priced" else float(v), nargs="+",
                   default=[cpu["draft_confidence_threshold"]],
                   help="draft_confidence_threshold values ('priced': each engine's, from its verification rows' cost)")
    p.add_argument("--disable-by-batch-size", type=int, default=cpu["disable_by_batch_size"])
    p.add_argument("--adaptive", choices=["on", "off", "both"], default="on",
                   help="the governor for every setting, or each with and without it (off: every step drafts, "
                        "so tau compares heads on the same steps)")
    p.add_argument("--no-adaptive", dest="adaptive", action="store_const", const="off", help="--adaptive off")
    p.add_argument("--lookup-branch", choices=["off", "on", "both"], default="off",
                   help="prompt_lookup_branch for every top_k, or each top_k with and without it")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--draft", nargs="+", default=[None], help="EAGLE3 head directories (default: the shipped head)")
    args = p.parse_args()

    engines = {"plain": Engine(EngineConfig())}
    both = {"off": [False], "on": [True], "both": [False, True]}
    branches, governed = both[args.lookup_branch], both[args.adaptive]
    settings = ((d, n, k, w, b, t, a) for d in args.draft for n in args.num_speculative_tokens for k in args.top_k
                for w in args.tree_width for b in branches for t in args.threshold for a in governed)
    for draft, n, k, width, branch, threshold, adaptive in settings:
        name = _name(args, draft, n, k, width, branch, threshold, adaptive and len(governed) > 1)
        engines[name] = Engine(EngineConfig(speculative={
            "method": "eagle3", "model": draft, "num_speculative_tokens": n, "draft_tree_width": width,
            "draft_top_k": k, "draft_confidence_threshold": threshold,
            "disable_by_batch_size": args.disable_by_batch_size, "prompt_lookup_branch": branch,
            "prompt_lookup_min": args.prompt_lookup_min, "adaptive": adaptive}))
    tokenizer = engines["plain"].tokenizer
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}])
               for text in read_prompts(args.prompts)[: args.max_prompts]]
    params = SamplingParams(max_tokens=args.max_tokens)
    seconds = {name: [] for name in engines}
    tokens = {name: 0 for name in engines}
    acceptance = {name: AcceptanceStats() for name in engines}
    lossless = True
    warm_up(list(engines.values()), prompts[0])
    batches = range(0, len(prompts), args.batch_size)
    for turn, start in enumerate(tqdm(batches, desc="bench spec_turns", unit="batch")):
        batch = prompts[start : start + args.batch_size]
        outputs = {}
        for name in list(engines)[:: 1 if turn % 2 == 0 else -1]:
            outputs[name], elapsed, stats = run_batch(engines[name], batch, params)
            for s in stats:
                acceptance[name].merge(s)
            seconds[name].append(elapsed)
            tokens[name] += sum(map(len, outputs[name]))
        lossless &= all(out == outputs["plain"] for out in outputs.values())
    names = list(engines)
    result = {
        "num_prompts": len(prompts), "batch_size": args.batch_size, "max_tokens": args.max_tokens,
        "draft_confidence_threshold": {n: round(engines[n].draft_confidence_threshold, 3) for n in names[1:]},
        "prompt_lookup_min": args.prompt_lookup_min, "tokens_per_s": {n: round(tokens[n] / sum(seconds[n]), 2) for n in names},
        "tau": {n: round(acceptance[n].mean_acceptance_length, 3) for n in names[1:]},
        "drafted": {n: acceptance[n].drafted for n in names[1:]},
        # time of the row's setting over the column's, median over batches: > 1 = the column is faster
        "median_time_ratio": {a: {b: round(statistics.median(x / y for x, y in zip(seconds[a], seconds[b])), 3)
                                  for b in names if b != a} for a in names},
        "lossless": lossless,
    }
    print(json.dumps(result))
    print(f"\n| setting | tau | tok/s | {' | '.join(f'time / {n}' for n in names)} |")
    print("|---" * (len(names) + 3) + "|")
    for a in names:
        cells = " | ".join("" if a == b else f"{result['median_time_ratio'][a][b]:.3f}" for b in names)
        print(f"| {a} | {result['tau'].get(a, 1.0):.3f} | {result['tokens_per_s'][a]:.1f} | {cells} |")


def _name(args, draft, n: int, k: int, width: int, branch: bool, threshold: float | None, governed: bool) -> str:
    """A setting's name: top_k, and each other field the run varies."""
    return ((f"{draft}:" if len(args.draft) > 1 else "") + (f"K={n}," if len(args.num_speculative_tokens) > 1 else "")
            + f"top_k={k}" + (f",width={width}" if len(args.tree_width) > 1 else "") + ("+lookup" if branch else "")
            + (f",P={'priced' if threshold is None else threshold}" if len(args.threshold) > 1 else "")
            + (",governed" if governed else ""))


if __name__ == "__main__":
    main()
