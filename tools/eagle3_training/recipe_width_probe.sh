#!/usr/bin/env bash
# Capacity probe (issue 18): the data-vs-acceptance curve says a doubling of the data buys ~+0.03-0.04
# position-1 accuracy near 10M tokens, far short of tau 2.5; does a wider head buy more? Heads trained
# from scratch on the same 15 % of corpus part 1's batches (the trainer's seeded order: the same ~1.5M
# tokens for every width, same schedule), with the MLP width the target has (1536) and wider ones, then
# measured teacher-forced on the held-out chat prompts (the answers kept in $BASE/answers, so every
# head sees the same ones). Resumable: run again to go on (training resumes from its checkpoint; a
# head is measured once its training has finished). Checkpoints stay outside the repository.
#   RUN1=DIR BASE=DIR WIDTHS="4096 1536" HOURS=H bash tools/eagle3_training/recipe_width_probe.sh
set -euo pipefail
RUN1=${RUN1:-$HOME/.cache/pdspec/eagle3-corpus}  # part 1: its mix.jsonl and data/
BASE=${BASE:-$HOME/.cache/pdspec/eagle3-width}
PY=${PY:-.venv/bin/python}
[ -s "$RUN1/data/done.json" ] || { echo "part 1 ($RUN1/data) first: bash tools/eagle3_training/recipe_corpus.sh" >&2; exit 1; }
for width in ${WIDTHS:-4096 1536}; do
    run="$BASE/mlp$width"
    mkdir -p "$run"
    ln -sfn "$RUN1/data" "$run/data"
    $PY -m deploy.cli train-eagle3 --prompts "$RUN1/mix.jsonl" --out "$run" --stage train \
        --epochs 0.15 --ttt-steps 4 --lr 5e-4 --draft-intermediate-size "$width" --max-hours "${HOURS:-2}"
    finished=$($PY -c 'import json, sys; print(json.load(open(sys.argv[1]))["finished"])' "$run/training.json")
    if [ "$finished" = True ] && [ ! -s "$run/accuracy.txt" ]; then
        $PY -m bench.draft_accuracy --max-new-tokens 128 --work "$BASE/answers" --draft "$run" > "$run/accuracy.tmp"
        mv "$run/accuracy.tmp" "$run/accuracy.txt"
    fi
done
