#!/usr/bin/env bash
# Create .venv with Python 3.12 and install exactly requirements.lock (no dependency resolution:
# megatron-bridge's own dependencies would downgrade megatron-core and pull gigabytes), then this
# package in editable mode. Re-runs are instant while requirements.lock is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3.12 -m venv .venv
fi
stamp=".venv/.installed-$(sha256sum requirements.lock pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements.lock
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
    rm -f .venv/.installed-*
    touch "$stamp"
fi
