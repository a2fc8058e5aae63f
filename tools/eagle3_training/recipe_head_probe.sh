#!/usr/bin/env bash
# Head probes (issue 18): what buys acceptance besides data? Heads trained from scratch on the same
# 15 % of corpus part 1's batches (the trainer's seeded order: the same ~1.5M tokens for every head,
# same schedule), one per RUNS entry ("name=flags;...": the train-eagle3 flags that make it differ),
# each then measured teacher-forced on the held-out chat prompts (the answers kept in $BASE/answers,
# so every head sees the same ones). Resumable: run again to go on (training resumes from its
# checkpoint; a head is measured once its training has finished). Checkpoints stay outside the
# repository.
#   The capacity probe (BENCHMARKS): BASE=~/.cache/pdspec/eagle3-width
#     RUNS="mlp4096=--draft-intermediate-size 4096;mlp1536=;layers2=--draft-layers 2"
#   The feature layers probe (the default): BASE=~/.cache/pdspec/eagle3-aux
#     RUNS="base=;top=--aux-layers 2 15 30;late=--aux-layers 20 25 30"
#   RUN1=DIR BASE=DIR RUNS=... HOURS=H bash tools/eagle3_training/recipe_head_probe.sh
set -euo pipefail
RUN1=${RUN1:-$HOME/.cache/pdspec/eagle3-corpus}  # part 1: its mix.jsonl and data/
BASE=${BASE:-$HOME/.cache/pdspec/eagle3-aux}
RUNS=${RUNS:-"base=;top=--aux-layers 2 15 30;late=--aux-layers 20 25 30"}
PY=${PY:-.venv/bin/python}
[ -s "$RUN1/data/done.json" ] || { echo "part 1 ($RUN1/data) first: bash tools/eagle3_training/recipe_corpus.sh" >&2; exit 1; }
IFS=';' read -ra entries <<< "$RUNS"
for entry in "${entries[@]}"; do
    name=${entry%%=*}
    read -ra flags <<< "${entry#*=}"
    run="$BASE/$name"
    mkdir -p "$run"
    ln -sfn "$RUN1/data" "$run/data"
    $PY -m deploy.cli train-eagle3 --prompts "$RUN1/mix.jsonl" --out "$run" --stage train --epochs 0.15 \
        --ttt-steps 4 --lr 5e-4 --max-hours "${HOURS:-2}" "${flags[@]}"
    finished=$($PY -c 'import json, sys; print(json.load(open(sys.argv[1]))["finished"])' "$run/training.json")
    if [ "$finished" = True ] && [ ! -s "$run/accuracy.txt" ]; then
        $PY -m bench.draft_accuracy --max-new-tokens 128 --work "$BASE/answers" --draft "$run" > "$run/accuracy.tmp"
        mv "$run/accuracy.tmp" "$run/accuracy.txt"
    fi
done
