"""What EAGLE3 loses where the draft cache is not kept current. Above `disable_by_batch_size` the
engine captures the target's features for prompts only (engine/spec/eagle3_proposer.py), so the
draft cache misses the positions a sequence decodes there. Two cases, each on one engine where
the draft cache is current (the sequence decodes alone, drafting) and one where it is not (it
decodes beside a companion request, above a batch limit of 1), greedy, tokens per drafting step:
- resume: over a sequence's tokens after its first --before ones (the companion ends there, and
  the sequence drafts again alone);
- follow-up: over a second turn's answer, its prompt holding the first turn's answer, which the
  prefix cache serves (decoded alone, or beside the companion).
Prints one JSON object, then a table.

    python -m bench.draft_upkeep [--prompts bench/prompts/chat_eval.jsonl] [--max-prompts 12] [--before 96] [--after 96]
"""

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from engine import cpu_kernels
from engine.config import EngineConfig
from engine.engine import Engine
from engine.params import SamplingParams
from engine.stats import AcceptanceStats
from tools.loadgen import print_table
from tools.prompts import read_prompts

PROMPTS = Path(__file__).parent / "prompts" / "chat_eval.jsonl"
FOLLOW_UP = "Thanks. Now say the same thing again in fewer words."
SPEC = {"method": "eagle3", "adaptive": False, "draft_confidence_threshold": 0.0, "num_speculative_tokens": 4,
        "draft_top_k": 1, "disable_by_batch_size": 1}  # drafting every step it may: acceptance alone


def decode(engine: Engine, prompt: list[int], n: int, companion: list[int] | None,
           before: int) -> tuple[list[int], tuple[int, int]]:
    """The prompt's n greedy tokens (EOS ignored), with a companion request decoding beside it for its
    first `before` tokens; and (drafting steps, tokens they emitted) after those."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    if companion is not None:
        engine.add_request(companion, SamplingParams(max_tokens=before, ignore_eos=True))
    seq, tokens, then = engine.seqs[rid], [], None
    while engine.has_unfinished():
        tokens += [t for out in engine.step() if out.request_id == rid for t in out.token_ids]
        if then is None and len(tokens) >= before:
            then = _steps_and_tokens(seq.acceptance)
    now = _steps_and_tokens(seq.acceptance)
    return tokens, (now[0] - then[0], now[1] - then[1])


def _steps_and_tokens(stats: AcceptanceStats) -> tuple[int, int]:
    return stats.steps, stats.steps + stats.accepted


def tokens_per_step(counts: list[tuple[int, int]]) -> float:
    return round(sum(t for _, t in counts) / sum(s for s, _ in counts), 3)


@torch.inference_mode()  # held as the engine loop's thread holds it: no step enters it (engine/inference.py)
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=Path, default=PROMPTS)
    ap.add_argument("--max-prompts", type=int, default=12)
    ap.add_argument("--before", type=int, default=96, help="tokens decoded before the sequence drafts again")
    ap.add_argument("--after", type=int, default=96, help="tokens measured after them (the follow-up's answer too)")
    args = ap.parse_args()
    questions = read_prompts(args.prompts)
    if len(questions) < 2 * args.max_prompts:
        ap.error(f"{args.prompts} holds {len(questions)} prompts; --max-prompts {args.max_prompts} needs twice as many")
    engines = {kept: Engine(EngineConfig(num_kv_blocks=256, speculative=SPEC)) for kept in (True, False)}
    chat = engines[True].tokenizer.encode_chat
    results: dict[str, dict[bool, list[tuple[int, int]]]] = {"resume": {True: [], False: []},
                                                             "follow_up": {True: [], False: []}}
    for i in tqdm(range(args.max_prompts), desc="bench draft_upkeep", unit="prompt"):
        messages = [{"role": "user", "content": questions[i]}]
        companion = chat([{"role": "user", "content": questions[args.max_prompts + i]}])
        for kept, engine in engines.items():
            answer, resumed = decode(engine, chat(messages), args.before + args.after, None if kept else companion,
                                     args.before)
            results["resume"][kept].append(resumed)
            turn = messages + [{"role": "assistant", "content": engine.tokenizer.decode(answer[: args.before])},
                               {"role": "user", "content": FOLLOW_UP}]
            results["follow_up"][kept].append(decode(engine, chat(turn), args.after, None, 0)[1])
    summary = {("kept" if kept else "missing"): {case: tokens_per_step(by[kept]) for case, by in results.items()}
               for kept in (True, False)}  # the draft cache kept current, or missing the positions
    print(json.dumps({"isa": cpu_kernels.selected_isa(), "prompts": args.max_prompts, "before": args.before,
                      "after": args.after, "tokens_per_drafting_step": summary}))
    print()
    print_table(summary, list(results))


if __name__ == "__main__":
    main()
