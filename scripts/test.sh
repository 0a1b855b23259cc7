#!/usr/bin/env bash
# Install everything the tests need into .venv (from scratch on a new machine) and run them.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not real"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m pytest -q "$@"
