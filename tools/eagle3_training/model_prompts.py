"""Prompts the target writes itself, for self-distillation data worded less uniformly than the
templates of synthetic_prompts.py (whose topics it reuses, so held-out topics stay out).

The target is asked for a question about a topic, sampled at temperature 0.7 / top-p 0.9 (at
0.9 a 135M model's text falls apart; greedy answers "I'm ready to help"). About 40 % of its
answers quote a question; the first quoted one is kept. Duplicates are dropped, and so is any
question whose words overlap a held-out evaluation prompt's by half or more.

Each batch's finds go to FILE.progress as the batch ends; run again with the same arguments after
an interruption, and it starts where the progress file stopped (with the result an uninterrupted
run gives), then replaces the progress file with FILE, whole.

    python -m tools.eagle3_training.model_prompts --out FILE [--count N] [--seed S] [--batch-size B]
"""

import argparse
import hashlib
import json
import os
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
ALL_TOPICS = TOPICS + MORE_TOPICS + NEW_TOPICS
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


def model_prompts(count: int, seed: int = 0, batch_size: int = 48, target: str | None = None,
                  progress_file: Path | None = None) -> list[str]:
    """`count` questions the target writes. progress_file: each batch's finds are appended to it as
    the batch ends, and a run given the file of an interrupted one (same arguments, asks, topics and
    held-out prompts) goes on from there: the batches it holds are not asked again. (Its result is
    an uninterrupted run's where the engine computes a prompt's rows alike with or without its
    prefix cached, as the CPU kernels do; elsewhere later batches may differ, still valid prompts.)"""
    rng = random.Random(seed)
    held_out_prompts = [p for f in sorted(HELD_OUT.glob("*.jsonl")) for p in read_prompts(f)]
    held_out = [_words(p) for p in held_out_prompts]
    header = _progress_header(count, seed, batch_size, target, held_out_prompts)
    done = _batches_done(progress_file, header) if progress_file else []
    for _ in done:  # the random draws of the batches already run, so the next ones draw as they would have
        _asks(rng, ALL_TOPICS, batch_size)
    found = dict.fromkeys(q for batch in done for q in batch)  # an insertion-ordered set
    engine = Engine(EngineConfig(model=target, max_num_seqs=batch_size, num_kv_blocks=batch_size * 8))
    progress = tqdm(total=count, initial=min(len(found), count), desc="model-written prompts", unit="prompt")
    while len(found) < count:
        new = []
        for answer in _answers(engine, _asks(rng, ALL_TOPICS, batch_size)):
            question = first_question(answer)
            if question and question not in found and not overlaps(question, held_out) and len(found) < count:
                found[question] = None
                new.append(question)
                progress.update(1)
        if progress_file:
            _append_durably(progress_file, header if not done else None, new)
            done.append(new)
    progress.close()
    return list(found)


def _progress_header(count: int, seed: int, batch_size: int, target: str | None, held_out: list[str]) -> dict:
    """What a progress file's batches were drawn with: a run's arguments, and a digest of the asks,
    topics and held-out prompts (a resume after they changed would mix two runs' draws)."""
    inputs = [ASKS, ALL_TOPICS, held_out]
    digest = hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:16]
    return {"count": count, "seed": seed, "batch_size": batch_size, "target": target, "inputs": digest}


def _asks(rng: random.Random, topics: list[str], n: int) -> list[tuple[str, int]]:
    """n requests for a question: their text and sampling seed."""
    return [(rng.choice(ASKS).format(t=rng.choice(topics)), rng.randrange(2**31)) for _ in range(n)]


def _answers(engine: Engine, asks: list[tuple[str, int]]) -> list[str]:
    """The target's answer to each ask, sampled with its seed (the same answer in any run)."""
    ids = [engine.add_request(engine.tokenizer.encode_chat([{"role": "user", "content": text}]),
                              SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, seed=ask_seed))
           for text, ask_seed in asks]
    answers: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            answers[out.request_id].extend(out.token_ids)
    return [engine.tokenizer.decode(answers[i]) for i in ids]


def _batches_done(path: Path, header: dict) -> list[list[str]]:
    """The finds of each batch the progress file holds (none if there is none). A line cut by an
    interruption is dropped from the file (the file too if no batch is left: the next batch's
    write starts it again, header first), and its batch runs again."""
    text = path.read_text() if path.exists() else ""
    lines = text.splitlines()
    ended = lines if text.endswith("\n") else lines[:-1]  # a last line without its newline was cut, though it may parse
    parsed = []
    for line in ended:
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            break
    if parsed and parsed[0].get("header") != header:
        raise ValueError(f"{path}: written by a run with {parsed[0].get('header')}, not {header}; "
                         "give the same --count, --seed and --batch-size, or delete it to start again")
    batches = [row["found"] for row in parsed[1:]]
    if not batches:
        path.unlink(missing_ok=True)
    elif len(parsed) < len(lines):
        write_text_durably(path, "".join(kept + "\n" for kept in lines[: len(parsed)]))
    return batches


def _append_durably(path: Path, header: dict | None, found: list[str]) -> None:
    """One batch's finds (after the header, for the first) on disk before the next batch starts."""
    with path.open("a") as f:
        if header is not None:
            f.write(json.dumps({"header": header}) + "\n")
        f.write(json.dumps({"found": found}) + "\n")
        f.flush()
        os.fsync(f.fileno())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=48)
    args = ap.parse_args()
    progress_file = args.out.with_name(args.out.name + ".progress")
    prompts = model_prompts(args.count, args.seed, args.batch_size, progress_file=progress_file)
    # Whole or not at all: the recipes skip a file that is there.
    write_text_durably(args.out, "".join(json.dumps({"source": "synthetic/model-written", "prompt": p}) + "\n"
                                         for p in prompts))
    progress_file.unlink(missing_ok=True)  # (none when nothing was asked: --count 0)
