#!/usr/bin/env bash
# The test command: set up .venv, then run every CPU test (GPU tests are marked and skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -m "not gpu" "$@"
