#!/usr/bin/env bash
# Corpus part 2 (issue 18: >= 20M answer tokens of the target's own answers; part 1,
# recipe_corpus.sh, holds 4.96M), then a head trained from scratch on both parts. Part 1 used 20,000
# of the 23,808 templated prompts there are, so part 2 is mostly prompts the target writes itself:
# 30,000 (ten files of 3,000, each resumable batch by batch; duplicates and part 1's prompts dropped), half of them
# followed by a second turn; plus two more turns after each of part 1's single-turn prompts (their
# first answers repeat part 1's; each such conversation adds two new answers). Estimated ~80K new
# answers (~13M answer tokens at part 1's 162 an answer; fewer, a follow-up being asked only after
# an answer that ended) beside ~19K repeated first answers; distilled, its shards held 9.10M answer
# tokens with 18,997 repeats (both parts 14.06M, of which training reads 10.89M: the repeats' 3.17M
# are skipped; BENCHMARKS). Several sessions of both cores (run
# again to go on; every step resumes where it stopped). Shards, the mix and checkpoints stay outside the repository; part 1's
# shards are linked into this run's data.
#   RUN1=DIR RUN=DIR HOURS=H bash tools/eagle3_training/recipe_corpus2.sh
set -euo pipefail
RUN1=${RUN1:-$HOME/.cache/pdspec/eagle3-corpus}  # part 1: its mix.jsonl and data/
RUN=${RUN:-$HOME/.cache/pdspec/eagle3-corpus2}
PY=${PY:-.venv/bin/python}
[ -s "$RUN1/mix.jsonl" ] || { echo "part 1 ($RUN1/mix.jsonl) first: bash tools/eagle3_training/recipe_corpus.sh" >&2; exit 1; }
# Part 1 distilled in full first: its shards are linked below, and a run started on part of them
# fixes its draft vocabulary and schedule on that (and refuses the rest later).
$PY -c "import sys; from pathlib import Path; from tools.prompts import read_conversations
from tools.eagle3_training.distill import check_distilled
check_distilled(Path(sys.argv[1]) / 'data', len(read_conversations(Path(sys.argv[1]) / 'mix.jsonl')))" "$RUN1"
mkdir -p "$RUN/data"
for part in 0 1 2 3 4 5 6 7 8 9; do
    [ -s "$RUN/model_prompts_$part.jsonl" ] || $PY -m tools.eagle3_training.model_prompts \
        --out "$RUN/model_prompts_$part.jsonl" --count 3000 --seed $((20 + part))
done
[ -s "$RUN/mix.jsonl" ] || $PY - "$RUN" "$RUN1" <<'MIX'
import json, random, sys
from engine.conversions import write_text_durably
from pathlib import Path
from tools.eagle3_training.follow_ups import with_follow_ups
from tools.prompts import read_conversations, read_prompts
run, run1 = Path(sys.argv[1]), Path(sys.argv[2])
part1 = read_conversations(run1 / "mix.jsonl")
seen = {row if isinstance(row, str) else row[0] for row in part1}
written = list(dict.fromkeys(p for k in range(10) for p in read_prompts(run / f"model_prompts_{k}.jsonl")
                             if p not in seen))
singles = [row for row in part1 if isinstance(row, str)]
half = len(written) // 2
mix = written[:half] + with_follow_ups(written[half:], 2, seed=21) + with_follow_ups(singles, 3, seed=22)
random.Random(21).shuffle(mix)
write_text_durably(run / "mix.jsonl", "".join(json.dumps({"prompt": m} if isinstance(m, str) else {"turns": m}) + "\n"
                                            for m in mix))  # whole or not at all: a cut file would pass [ -s ]
print(f"{len(mix)} conversations, {sum(1 if isinstance(m, str) else len(m) for m in mix)} answers")
MIX
shopt -s nullglob
for shard in "$RUN1"/data/shard-[0-9]*.safetensors; do  # part 1's shards, trained on beside part 2's
    ln -sf "$shard" "$RUN/data/shard-p1-$(basename "$shard" .safetensors | cut -d- -f2).safetensors"
done
$PY -m deploy.cli train-eagle3 --prompts "$RUN/mix.jsonl" --out "$RUN" --stage distill --tokens-only \
    --max-new-tokens 192 --batch-size 48
$PY -m deploy.cli train-eagle3 --prompts "$RUN/mix.jsonl" --out "$RUN" --stage train --epochs 1 --ttt-steps 4 \
    --lr 5e-4 --max-hours "${HOURS:-1}" --snapshot-tokens 1e6 2e6 4e6 8e6
