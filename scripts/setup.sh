#!/usr/bin/env bash
# Create (or update) the project-local virtual environment .venv and install arborspec into it.
# Usage: bash scripts/setup.sh [extra]   e.g. `bash scripts/setup.sh test`
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# torch first, pinned exactly: a looser spec would pull several GB of CUDA wheels.
.venv/bin/python -m pip install -q -c constraints.txt "torch==2.13.0"
extra=${1:-}
spec="."
[ -n "$extra" ] && spec=".[$extra]"
.venv/bin/python -m pip install -q -c constraints.txt -e "$spec"
