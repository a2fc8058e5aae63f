"""Conversations for self-distillation: each prompt followed by further user turns of the kind chat
users send after an answer, so the head also learns to draft deep in a conversation, after the
target's own earlier answers.

    python -m tools.eagle3_training.follow_ups --prompts IN --out FILE [--turns 2] [--seed S]
"""

import argparse
import json
import random
from pathlib import Path

from tools.prompts import read_prompts

FOLLOW_UPS = [
    "Can you explain that in more detail?", "Can you give me an example?", "Summarize that in one sentence.",
    "Why is that?", "Can you make it shorter?", "What else should I know?", "Put that in a bulleted list.",
    "Thanks! What would you do first?", "Explain it as if I were ten years old.", "Are there any risks?",
    "Can you say that more formally?", "What is the most important point?", "How would an expert answer that?",
    "Give me three more ideas.", "What are the common mistakes here?", "Can you check your answer?",
    "How long would that take?", "What if I only had an hour?", "Rewrite that as a short email.",
    "Is there a simpler way?", "What are the pros and cons?", "Can you add a short conclusion?",
    "Now turn it into a step-by-step plan.", "Which part is the hardest, and why?", "Translate the first sentence into French.",
    "Write a catchy title for that.", "Could you give a real-world example?", "What would change in ten years?",
    "How do I explain this to my friend?", "Thanks. Can you continue?",
]


def with_follow_ups(prompts: list[str], turns: int = 2, seed: int = 0) -> list[list[str]]:
    """Each prompt as the first of `turns` user turns, the others drawn from FOLLOW_UPS (distinct)."""
    rng = random.Random(seed)
    return [[p] + rng.sample(FOLLOW_UPS, turns - 1) for p in prompts]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=Path, required=True, help="JSONL prompts (first turns)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.out.write_text("".join(json.dumps({"source": "follow-ups", "turns": t}) + "\n"
                                for t in with_follow_ups(read_prompts(args.prompts), args.turns, args.seed)))
