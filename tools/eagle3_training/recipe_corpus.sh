#!/usr/bin/env bash
# The corpus for a from-scratch head (issue 18: >= 20M tokens of the target's own answers), built
# across sessions. Part 1 (28K conversations: up to 38K answers, ~6M answer tokens at ~160 each):
# templated chat prompts over every topic and request shape, those near held-out evaluation
# prompts left out (a third followed by a second turn), all GSM8K train questions not held out (a
# quarter with a follow-up), the AlpacaEval instructions as three-turn conversations. A follow-up
# is asked only after an answer that ended (one cut at 192 tokens ends its conversation). The mix is
# fixed by its seeds and distilled in order; run again to go on where it stopped (done.json), stop
# it any time. Once every answer is distilled, a head is trained on them from scratch (warmup and
# cosine decay over one epoch, resumable, HOURS at a time; two epochs were ~7 h of both cores, more
# than a session can spare beside its other work), to set against the shipped one on
# held-out chat; it is exported as it stands after 0.5M, 1M, 2M and 4M answer tokens
# (RUN/snapshots/), for the data-vs-acceptance curve. Shards, the mix and checkpoints stay outside
# the repository; one process at a time works in RUN (a second one is refused).
#   RUN=DIR HOURS=H bash tools/eagle3_training/recipe_corpus.sh
set -euo pipefail
RUN=${RUN:-$HOME/.cache/pdspec/eagle3-corpus}
PY=${PY:-.venv/bin/python}
mkdir -p "$RUN"
[ -s "$RUN/mix.jsonl" ] || $PY - "$RUN" <<'MIX'
import json, random, sys
from engine.conversions import write_text_durably
from pathlib import Path
from tools.eagle3_training.follow_ups import with_follow_ups
from tools.eagle3_training.synthetic_prompts import away_from_held_out, synthetic_prompts
from tools.prompts import read_prompts
run, rng = Path(sys.argv[1]), random.Random(11)
rows = [json.loads(line) for line in open("../shared/data/train_prompts.jsonl")]
held_out = set(read_prompts(Path("bench/prompts/gsm8k_eval.jsonl")))
gsm8k = [r["prompt"] for r in rows if r["source"] == "gsm8k/train" and r["prompt"] not in held_out]
alpaca = [r["prompt"] for r in rows if r["source"].startswith("alpaca_eval")]
templated = away_from_held_out(synthetic_prompts(20000, seed=11))
mix = (templated[:13400] + with_follow_ups(templated[13400:], 2, seed=11)
       + gsm8k[: len(gsm8k) * 3 // 4] + with_follow_ups(gsm8k[len(gsm8k) * 3 // 4 :], 2, seed=12)
       + with_follow_ups(alpaca, 3, seed=13))
rng.shuffle(mix)
write_text_durably(run / "mix.jsonl", "".join(json.dumps({"prompt": m} if isinstance(m, str) else {"turns": m}) + "\n"
                                            for m in mix))  # whole or not at all: a cut file would pass [ -s ]
print(f"{len(mix)} conversations, {sum(1 if isinstance(m, str) else len(m) for m in mix)} answers")
MIX
$PY -m deploy.cli train-eagle3 --prompts "$RUN/mix.jsonl" --out "$RUN" --stage distill --tokens-only \
    --max-new-tokens 192 --batch-size 48
$PY -m deploy.cli train-eagle3 --prompts "$RUN/mix.jsonl" --out "$RUN" --stage train --epochs 1 --ttt-steps 4 \
    --lr 5e-4 --max-hours "${HOURS:-1}" --snapshot-tokens 5e5 1e6 2e6 4e6
