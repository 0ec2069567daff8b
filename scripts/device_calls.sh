#!/usr/bin/env bash
# Issue 39's closing measurements as two 10-minute device calls on one warm machine, each carrying
# the packed site (scripts/device_site.sh → .site/site.tar.xz; run's carry [".site"]):
#   bash scripts/device_calls.sh targets      # 1. bench_dsa's targets run (every target of the issue,
#                                             #    ~155 s), its bwd_parts per TP rank (< 1 min), on an
#                                             #    H200 also bench_bwd_floor.py, then the GPU suite
#                                             #    without its real-width test (~250 s)
#   bash scripts/device_calls.sh real_width   # 2. the GPU suite's real-width test (7+ min)
# Every step has its own time limit inside the call's 600 s, so a step that overruns still leaves
# the earlier steps' files under $OUT (dsa/, t/, r/, *_stdout.txt, times.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/device_calls}
mkdir -p "$out" /tmp/site
t0=$(date +%s)
left() { echo $(( ${1:-585} - ($(date +%s) - t0) )); }
stamp() { echo "$1: $(( $(date +%s) - t0 )) s" | tee -a "$out/times.txt"; }
if [ ! -d /tmp/site/tilelang ]; then
  tar -C /tmp/site -xJf .site/site.tar.xz
  # the packed site has no bytecode (pip --no-compile keeps the carry small); without it each of the
  # ~50 Python processes below may compile tilelang, megatron and transformers again (the CPU machines
  # set PYTHONDONTWRITEBYTECODE; there, importing the three took 6.0 s without and 4.6 s with it)
  python3 -m compileall -q -j 0 /tmp/site > /dev/null 2>&1
  stamp "site unpacked and compiled"
fi
export PYTHONPATH=/tmp/site:$PWD
case "${1:-}" in
  targets)
    BENCH_TIMEOUT=300 OUT=$out/dsa timeout 420 bash benchmarks/run_device.sh \
        --parts check,sparse,indexer,compile,dense,tp --seqs 8192,16384 --heads 64 --reps 5 > "$out/dsa_stdout.txt" 2>&1
    stamp "targets"
    # the backward's split per token-parallel rank (TP 8's slowest rank: its adds?) and in select_topk's
    # ascending slot order; the kernels come from run_device.sh's builds
    timeout 120 python3 benchmarks/bench_dsa.py --parts bwd_parts --seqs 8192 --heads 64 --bwd-tp 8,4 \
        --out "$out/bwd_parts.json" > "$out/bwd_parts.txt" 2>&1
    stamp "bwd_parts"
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      timeout 120 python3 benchmarks/bench_bwd_floor.py --out "$out/bwd_floor.json" > "$out/bwd_floor.txt" 2>&1
      stamp "bwd_floor"
    fi
    OUT=$out/t timeout "$(left)" bash scripts/gpu_tests.sh --no-bench -k "not real_width" > "$out/suite_stdout.txt" 2>&1
    rc=$?
    stamp "suite (rc $rc)"
    grep -h '"kind": "target"' "$out/dsa/bench.log" 2>/dev/null | cut -c1-220
    tail -2 "$out/suite_stdout.txt"
    exit "$rc" ;;
  real_width)
    OUT=$out/r timeout "$(left 590)" bash scripts/gpu_tests.sh --no-bench -k real_width > "$out/real_stdout.txt" 2>&1
    rc=$?
    stamp "real_width (rc $rc)"
    tail -3 "$out/real_stdout.txt"
    exit "$rc" ;;
  *) echo "usage: bash scripts/device_calls.sh targets|real_width" >&2; exit 2 ;;
esac
