"""Prompts the target writes itself, for self-distillation data worded less uniformly than the
templates of synthetic_prompts.py (whose topics it reuses, so held-out topics stay out).

The target is asked for a question about a topic, sampled at temperature 0.7 / top-p 0.9 (at
0.9 a 135M model's text falls apart; greedy answers "I'm ready to help"). About 40 % of its
answers quote a question; the first quoted one is kept. Duplicates are dropped, and so is any
question whose words overlap a held-out evaluation prompt's by half or more.

    python -m tools.eagle3_training.model_prompts --out FILE [--count N] [--seed S] [--batch-size B]
"""

import argparse
import json
import random
import re
from pathlib import Path

from tqdm import tqdm

from engine.config import EngineConfig
from engine.conversions import write_text_durably
from engine.engine import Engine
from engine.params import SamplingParams
from tools.prompts import read_prompts
from tools.eagle3_training.synthetic_prompts import MORE_TOPICS, NEW_TOPICS, TOPICS

ASKS = [
    "Write one question that a curious person might ask an AI assistant about {t}. Reply with the question only.",
    "Write a request that a user might send to a helpful assistant about {t}. Reply with the request only.",
    "Give an example of a question someone could ask about {t}. Reply with the question only.",
]
HELD_OUT = Path(__file__).resolve().parents[2] / "bench" / "prompts"
QUOTED = re.compile(r'"([^"\n]{12,200}\?)"')


COMMON = set("what what's that this with your have about some best good make does from they there when which "
             "would could should tell explain give write someone something their".split())


def _words(text: str) -> set[str]:
    """Content words: four letters or more, the commonest question words left out."""
    return {w for w in re.findall(r"[a-z']+", text.lower()) if len(w) >= 4 and w not in COMMON}


def first_question(answer: str) -> str | None:
    """The first quoted question of an answer, or None."""
    match = QUOTED.search(answer)
    return match.group(1).strip() if match else None


def overlaps(question: str, held_out: list[set[str]]) -> bool:
    """Half or more of the content words of the question or of some held-out prompt are shared."""
    words = _words(question)
    return any(len(words & h) >= max(1, 0.5 * min(len(words), len(h))) for h in held_out)


def model_prompts(count: int, seed: int = 0, batch_size: int = 48, target: str | None = None) -> list[str]:
    rng = random.Random(seed)
    topics = TOPICS + MORE_TOPICS + NEW_TOPICS
    held_out = [_words(p) for f in sorted(HELD_OUT.glob("*.jsonl")) for p in read_prompts(f)]
    engine = Engine(EngineConfig(model=target, max_num_seqs=batch_size, num_kv_blocks=batch_size * 8))
    found: dict[str, None] = {}  # insertion-ordered set
    progress = tqdm(total=count, desc="model-written prompts", unit="prompt")
    while len(found) < count:
        ids = [engine.add_request(
            engine.tokenizer.encode_chat([{"role": "user", "content": rng.choice(ASKS).format(t=rng.choice(topics))}]),
            SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, seed=rng.randrange(2**31)))
            for _ in range(batch_size)]
        answers = {i: [] for i in ids}
        while engine.has_unfinished():
            for out in engine.step():
                answers[out.request_id].extend(out.token_ids)
        for i in ids:
            question = first_question(engine.tokenizer.decode(answers[i]))
            if question and question not in found and not overlaps(question, held_out) and len(found) < count:
                found[question] = None
                progress.update(1)
    progress.close()
    return list(found)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=48)
    args = ap.parse_args()
    # Whole or not at all: the recipes skip a file that is there.
    write_text_durably(args.out, "".join(json.dumps({"source": "synthetic/model-written", "prompt": p}) + "\n"
                                         for p in model_prompts(args.count, args.seed, args.batch_size)))
