#!/usr/bin/env bash
# Capacity probe (issue 18): the data-vs-acceptance curve says a doubling of the data buys ~+0.03-0.04
# position-1 accuracy near 10M tokens, far short of tau 2.5; does a larger head buy more? Heads trained
# from scratch on the same 15 % of corpus part 1's batches (the trainer's seeded order: the same ~1.5M
# tokens for every head, same schedule): the shipped shape (one layer, the target's MLP width 1536), a
# 2.7x wider MLP, and two layers (outside the published format: measured, not served). Each is then
# measured teacher-forced on the held-out chat prompts (the answers kept in $BASE/answers, so every
# head sees the same ones). Resumable: run again to go on (training resumes from its checkpoint; a head
# is measured once its training has finished). Checkpoints stay outside the repository.
#   RUN1=DIR BASE=DIR RUNS="name:width:layers ..." HOURS=H bash tools/eagle3_training/recipe_capacity_probe.sh
set -euo pipefail
RUN1=${RUN1:-$HOME/.cache/pdspec/eagle3-corpus}  # part 1: its mix.jsonl and data/
BASE=${BASE:-$HOME/.cache/pdspec/eagle3-width}
PY=${PY:-.venv/bin/python}
[ -s "$RUN1/data/done.json" ] || { echo "part 1 ($RUN1/data) first: bash tools/eagle3_training/recipe_corpus.sh" >&2; exit 1; }
for spec in ${RUNS:-mlp4096:4096:1 mlp1536:1536:1 layers2:1536:2}; do
    IFS=: read -r name width layers <<< "$spec"
    run="$BASE/$name"
    mkdir -p "$run"
    ln -sfn "$RUN1/data" "$run/data"
    $PY -m deploy.cli train-eagle3 --prompts "$RUN1/mix.jsonl" --out "$run" --stage train --epochs 0.15 \
        --ttt-steps 4 --lr 5e-4 --draft-intermediate-size "$width" --draft-layers "$layers" --max-hours "${HOURS:-2}"
    finished=$($PY -c 'import json, sys; print(json.load(open(sys.argv[1]))["finished"])' "$run/training.json")
    if [ "$finished" = True ] && [ ! -s "$run/accuracy.txt" ]; then
        $PY -m bench.draft_accuracy --max-new-tokens 128 --work "$BASE/answers" --draft "$run" > "$run/accuracy.tmp"
        mv "$run/accuracy.tmp" "$run/accuracy.txt"
    fi
done
