#!/usr/bin/env bash
# The main job on the embedded default (tiny GLM-5.2), after setting up .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/glm5-bridge demo --workdir runs/demo "$@"
