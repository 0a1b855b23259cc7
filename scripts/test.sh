#!/usr/bin/env bash
# Install everything the tests need into .venv (from scratch on a new machine) and run them, one pytest-xdist worker
# per core (each pinned to its core: tests/conftest.py). Extra arguments go to pytest, e.g.
# `bash scripts/test.sh -m "not real"`, or `-n 0` for one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m pytest -q -n logical --dist loadgroup "$@"
