#!/usr/bin/env bash
# Set up (if needed) and run the main job: the local cluster (router, prefill and decode workers
# as Ray actors, EAGLE3 on the embedded model) answers one chat request, then shuts down.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/bootstrap.sh"
# From the caller's directory: paths given as arguments are the caller's.
if [[ $# -eq 0 ]]; then
    set -- serve --config "$root/deploy/configs/local.yaml" --once "What is the capital of France? Answer in one sentence."
fi
exec "$root/.venv/bin/pdspec" "$@"
