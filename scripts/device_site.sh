#!/usr/bin/env bash
# Pack the device machine's missing packages (../shared/device/wheels.sh: tilelang, tvm-ffi, z3,
# megatron-core/-bridge, transformers, ...) into ONE carry of under 64 MiB: installed here for
# Python 3.12 / x86-64, then tar + xz (the wheels' zip is too weak: .whl-a + .whl-b are ~97 MiB).
# One call then installs and runs, so no machine can go cold between two install calls:
#   bash scripts/device_site.sh          # here, once (~3 min for xz); writes .site/site.tar.xz
#   run, carry [".site"]: mkdir -p /tmp/site && tar -C /tmp/site -xJf .site/site.tar.xz \
#                         && export PYTHONPATH=/tmp/site:$PWD && <your command>
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .whl-a ] && [ -d .whl-b ] || bash ../shared/device/wheels.sh
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014; do platforms+=(--platform "${p}_x86_64"); done
# --python-version / --platform: install for the device's Python, whatever Python runs here
python3 -m pip install -q --ignore-requires-python --no-index --no-deps --no-compile --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" --target "$tmp/site" .whl-a/*.whl .whl-b/*.whl
mkdir -p .site  # ignored (.gitignore); name it in carry
tar -C "$tmp/site" -cf - . | xz -T0 -9e > .site/site.tar.xz.part
mv .site/site.tar.xz.part .site/site.tar.xz  # renamed into place: a cut-short run leaves no half archive
ls -l .site/site.tar.xz
