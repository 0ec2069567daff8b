#!/usr/bin/env bash
# Create or update .venv from uv.lock: `uv sync --frozen` installs exactly the locked versions (the
# dev group too, for the tests) and this package in editable mode; a re-run with nothing changed
# takes a second. uv itself (the version below) comes from the registry into .tools/ when the
# machine has no such uv. Python 3.12 is pyenv's (.python-version); uv never downloads one.
# --compile-bytecode writes every installed module's .pyc once (26 s on 2 CPUs): machines here set
# PYTHONDONTWRITEBYTECODE=1, so without them each Python process compiled megatron, torch and
# transformers from source again (a 4-step tiny training run: 57 s without, 19 s with them).
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.8
uv=$(command -v uv || true)
if [ -z "$uv" ] || [ "$("$uv" --version | cut -d' ' -f2)" != "$UV_VERSION" ]; then
    if [ ! -x .tools/uv/bin/uv ]; then
        python3.12 -m pip install -q --disable-pip-version-check --target .tools/uv "uv==$UV_VERSION"
    fi
    uv=.tools/uv/bin/uv
fi
UV_PYTHON_DOWNLOADS=never "$uv" sync --frozen --group dev --python python3.12 --quiet --compile-bytecode
