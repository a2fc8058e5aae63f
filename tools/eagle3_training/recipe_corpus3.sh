#!/usr/bin/env bash
# Corpus part 3 (issue 18: >= 20M answer tokens of the target's own answers; parts 1 and 2 hold
# 10.89M that training reads, part 2's 18,997 repeats of part 1's first answers skipped). Part 2's
# new answers averaged ~74 tokens (follow-ups are short), so ~9.1M more new tokens take ~120K
# answers: every conversation here is multi-turn. 60,000 questions the target writes (twenty files
# of 3,000, seeds 40-59; duplicates and earlier parts' prompts dropped: ~48K left at part 2's 94 %
# kept, less as the seeds repeat topics), half followed by one more turn and half by two, plus the
# 3,787 templated prompts part 1 left unused as three-turn conversations: ~130K answers, ~9.6M
# answer tokens estimated. Then a head from scratch on all three parts (one epoch, snapshots at 1M
# to 16M answer tokens for the data-vs-acceptance curve). Part 2's rate: ~5.5 minutes a prompt file
# and ~3 hours of distillation per 9M answer tokens, both cores (Machine F); training ~9K steps at
# ~4 s. Several sessions: run again to go on (every step resumes where it stopped). Shards, the mix
# and checkpoints stay outside the repository; parts 1 and 2's shards are linked into this run's data.
#   RUN1=DIR RUN2=DIR RUN=DIR HOURS=H bash tools/eagle3_training/recipe_corpus3.sh
set -euo pipefail
RUN1=${RUN1:-$HOME/.cache/pdspec/eagle3-corpus}  # part 1: its mix.jsonl and data/
RUN2=${RUN2:-$HOME/.cache/pdspec/eagle3-corpus2}  # part 2: its mix.jsonl, model_prompts_*.jsonl and data/
RUN=${RUN:-$HOME/.cache/pdspec/eagle3-corpus3}
PY=${PY:-.venv/bin/python}
for part in "$RUN1" "$RUN2"; do  # both distilled in full first: a run fixes its vocabulary on the shards it finds
    [ -s "$part/mix.jsonl" ] || { echo "$part/mix.jsonl missing: recipe_corpus.sh, then recipe_corpus2.sh" >&2; exit 1; }
    $PY -c "import sys; from pathlib import Path; from tools.prompts import read_conversations
from tools.eagle3_training.distill import check_distilled
check_distilled(Path(sys.argv[1]) / 'data', len(read_conversations(Path(sys.argv[1]) / 'mix.jsonl')))" "$part"
done
mkdir -p "$RUN/data"
for part in $(seq 0 19); do
    [ -s "$RUN/model_prompts_$part.jsonl" ] || $PY -m tools.eagle3_training.model_prompts \
        --out "$RUN/model_prompts_$part.jsonl" --count 3000 --seed $((40 + part))
done
[ -s "$RUN/mix.jsonl" ] || $PY - "$RUN" "$RUN1" "$RUN2" <<'MIX'
import json, random, sys
from engine.conversions import write_text_durably
from pathlib import Path
from tools.eagle3_training.follow_ups import with_follow_ups
from tools.eagle3_training.synthetic_prompts import away_from_held_out, synthetic_prompts
from tools.prompts import read_conversations, read_prompts
run, run1, run2 = map(Path, sys.argv[1:4])
seen = {row if isinstance(row, str) else row[0] for part in (run1, run2) for row in read_conversations(part / "mix.jsonl")}
written = list(dict.fromkeys(p for k in range(20) for p in read_prompts(run / f"model_prompts_{k}.jsonl")
                             if p not in seen))
templated = [p for p in away_from_held_out(synthetic_prompts(10**6, seed=11, skip=20000)) if p not in seen]
half = len(written) // 2
mix = (with_follow_ups(written[:half], 2, seed=41) + with_follow_ups(written[half:], 3, seed=42)
       + with_follow_ups(templated, 3, seed=43))
random.Random(41).shuffle(mix)
write_text_durably(run / "mix.jsonl", "".join(json.dumps({"turns": m}) + "\n" for m in mix))  # whole or not at all
print(f"{len(mix)} conversations ({len(written)} model-written, {len(templated)} templated), "
      f"{sum(map(len, mix))} answers at most")
MIX
shopt -s nullglob
for shard in "$RUN1"/data/shard-[0-9]*.safetensors; do  # part 1's and part 2's own shards (not part 2's links)
    ln -sf "$shard" "$RUN/data/shard-p1-$(basename "$shard" .safetensors | cut -d- -f2).safetensors"
done
for shard in "$RUN2"/data/shard-[0-9]*.safetensors; do
    ln -sf "$shard" "$RUN/data/shard-p2-$(basename "$shard" .safetensors | cut -d- -f2).safetensors"
done
$PY -m deploy.cli train-eagle3 --prompts "$RUN/mix.jsonl" --out "$RUN" --stage distill --tokens-only \
    --max-new-tokens 192 --batch-size 48
$PY -m deploy.cli train-eagle3 --prompts "$RUN/mix.jsonl" --out "$RUN" --stage train --epochs 1 --ttt-steps 4 \
    --lr 5e-4 --max-hours "${HOURS:-1}" --snapshot-tokens 1e6 2e6 4e6 8e6 16e6
