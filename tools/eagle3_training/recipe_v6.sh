#!/usr/bin/env bash
# The v6 head: its data recipe and its training, each step resumable (run again to go on).
# Data of shapes the earlier heads never saw: prompts the target wrote itself, conversations
# (a follow-up turn answered after the target's own first answer), and more GSM8K questions.
#   RUN=DIR HOURS=H bash tools/eagle3_training/recipe_v6.sh
set -euo pipefail
RUN=${RUN:-$HOME/.cache/pdspec/eagle3-v6}  # outside the repository: shards and checkpoints
PY=${PY:-.venv/bin/python}
mkdir -p "$RUN"
[ -s "$RUN/model_prompts.jsonl" ] ||
    $PY -m tools.eagle3_training.model_prompts --out "$RUN/model_prompts.jsonl" --count 2400 --seed 6
[ -s "$RUN/mix.jsonl" ] || $PY - "$RUN" <<'MIX'
import json, random, sys
from pathlib import Path
from engine.conversions import write_text_durably
from tools.eagle3_training.follow_ups import with_follow_ups
from tools.prompts import read_prompts
run, rng = Path(sys.argv[1]), random.Random(9)
rows = [json.loads(line) for line in open("../shared/data/train_prompts.jsonl")]
held_out = set(read_prompts(Path("bench/prompts/gsm8k_eval.jsonl")))
gsm8k = [r["prompt"] for r in rows[3072:] if r["source"] == "gsm8k/train" and r["prompt"] not in held_out]
alpaca = [r["prompt"] for r in rows if r["source"].startswith("alpaca_eval")]
written = read_prompts(run / "model_prompts.jsonl")
mix = (written[:1200] + with_follow_ups(written[1200:], 2, seed=6) + with_follow_ups(alpaca, 2, seed=7)
       + rng.sample(gsm8k, 700))
rng.shuffle(mix)
write_text_durably(run / "mix.jsonl", "".join(json.dumps({"prompt": m} if isinstance(m, str) else {"turns": m}) + "\n"
                                       for m in mix))
MIX
$PY -m deploy.cli train-eagle3 --prompts "$RUN/mix.jsonl" --out "$RUN" --stage distill --tokens-only \
    --max-new-tokens 192 --batch-size 48
$PY -m deploy.cli train-eagle3 --prompts "$RUN/mix.jsonl" --out "$RUN" --stage train \
    --init-from engine/spec/eagle3_heads/SmolLM2-135M-Instruct-eagle3 --epochs 1 --ttt-steps 4 --lr 2e-4 \
    --max-hours "${HOURS:-0.75}"
