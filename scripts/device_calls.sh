#!/usr/bin/env bash
# Issue 39's closing measurements as two 10-minute device calls on one warm machine, each carrying
# the packed site (scripts/device_site.sh → .site/site.tar.xz; run's carry [".site"]):
#   bash scripts/device_calls.sh targets      # 1. bench_dsa's targets run (every target of the issue,
#                                             #    ~155 s), the GPU suite without its real-width test
#                                             #    (~250 s), then in the time left bwd_parts per TP
#                                             #    rank and bench_bwd_floor.py (REDs against bulk adds)
#   bash scripts/device_calls.sh real_width   # 2. the GPU suite's real-width test (7+ min)
# Every step has its own time limit inside the call's 600 s, so a step that overruns still leaves
# the earlier steps' files under $OUT (dsa/, t/, r/, *_stdout.txt, times.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/device_calls}
mkdir -p "$out" /tmp/site
t0=$(date +%s)
# seconds left until $1 (default 585) into the call; at least 1 (timeout 0 would mean no limit)
left() { local l=$(( ${1:-585} - ($(date +%s) - t0) )); echo $(( l > 1 ? l : 1 )); }
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
    OUT=$out/t timeout "$(left 520)" bash scripts/gpu_tests.sh --no-bench -k "not real_width" > "$out/suite_stdout.txt" 2>&1
    rc=$?
    stamp "suite (rc $rc)"
    # experiments in what time is left: the backward's split per token-parallel rank (TP 8's slowest
    # rank: its adds?) and in the radix select's ascending slot order (kernels from run_device.sh's
    # builds); the backward's traffic floor with the dKV adds as 16-byte REDs and as bulk reductions
    timeout "$(left)" python3 benchmarks/bench_dsa.py --parts bwd_parts --seqs 8192 --heads 64 --bwd-tp 8,4 \
        --out "$out/bwd_parts.json" > "$out/bwd_parts.txt" 2>&1
    stamp "bwd_parts"
    timeout "$(left)" python3 benchmarks/bench_bwd_floor.py --out "$out/bwd_floor.json" > "$out/bwd_floor.txt" 2>&1
    stamp "bwd_floor"
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
