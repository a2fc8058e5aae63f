#!/usr/bin/env bash
# Set up (if needed) and run the main job: the embedded default model answering a chat prompt.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/bootstrap.sh"
cd "$root"
if [[ $# -eq 0 ]]; then
    set -- generate --prompt "What is the capital of France? Answer in one sentence."
fi
exec "$root/.venv/bin/pdspec" "$@"
