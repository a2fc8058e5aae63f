#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite; the 15 slowest tests are listed at the end
# so the suite's cost stays visible.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/bootstrap.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest -q --durations=15 "$@"
