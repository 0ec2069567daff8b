#!/usr/bin/env bash
# Every GPU test, then the backend timings, on a CUDA machine with tilelang, megatron-core,
# megatron-bridge and transformers importable. On the device machine (benchmarks/README.md):
#   bash ../shared/device/wheels.sh                       # here, once: fills .whl-a / .whl-b
#   run 1, carry [".whl-a"]: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-a/*.whl
#   run 2, carry [".whl-b"]: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-b/*.whl \
#                             && PYTHONPATH=/tmp/site:$PWD bash scripts/gpu_tests.sh
# Arguments go to pytest (a first argument --no-bench skips step 3, the backend timings). The whole
# suite (~78 s of builds, ~4 min of kernel tests, the reduced real-width run 7+ min) does not fit one
# 10-minute device call: run it as two on one warm machine,
#   bash scripts/gpu_tests.sh -k "not real_width"   then   bash scripts/gpu_tests.sh --no-bench -k real_width
# (the second finds the kernels in TileLang's disk cache and leaves the timings to the first).
# Logs go to $OUT (default /tmp/gpu_tests): gpu.txt, compile.log, pytest.log, bench.log, results.jsonl.
# Exit status: pytest's.
set -uo pipefail
cd "$(dirname "$0")/.."
bench=1
if [ "${1:-}" = "--no-bench" ]; then bench=0; shift; fi
out=${OUT:-/tmp/gpu_tests}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 GLM5_GPU_RESULTS="$out/results.jsonl"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
rm -f "$GLM5_GPU_RESULTS"
source scripts/modelopt_standin.sh  # the real-width test's Megatron → HF step; the packed site has no modelopt

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv \
    | tee "$out/gpu.txt"
python3 -c "import torch, tilelang, megatron.core, transformers; print('torch', torch.__version__, '| tilelang', \
tilelang.__version__, '| megatron-core', megatron.core.__version__, '| transformers', transformers.__version__)" \
    | tee -a "$out/gpu.txt"

# 1. Compile the kernels the tests use, one process per kernel, in parallel: TileLang's disk cache
#    then serves the test processes (a kernel takes 10-30 s to compile). Shapes: GLM-5 dims
#    (64 heads, top-k 2048, scale 1/16; 16 and 128 heads for the kernel tests) and the tests' tiny
#    model (4 heads, top-k 8, 1/sqrt(80)) in bfloat16 and, for the fp32 model, float16.
start=$(date +%s)
pids=()
i=0
jobs=()
for shape in "64,2048,1/16" "16,2048,1/16" "8,2048,1/16" "4,8,1/math.sqrt(80)"; do
    for dtype in bfloat16 float16; do
        for part in fwd bwd delta; do jobs+=("$shape,parts=('$part',),dtype=torch.$dtype"); done
    done
done
jobs+=("128,2048,1/16,parts=('fwd',)" "128,2048,1/16,parts=('bwd','delta')" "64,2048,1/16,kernels='upstream'")
jobs+=("64,2048,1/16,parts=('slots',)" "4,8,1/math.sqrt(80),parts=('slots',)")  # kernel_indices' reordering
for dtype in bfloat16 float16; do jobs+=("32,2048,1/16,parts=('bwd','delta'),dtype=torch.$dtype"); done  # 32-head bwd tests
# test_head_blocked_rows_equal_token_rows: the kernels reading head-blocked rows
jobs+=("64,2048,1/16,parts=('fwd',),head_blocks=8" "64,2048,1/16,parts=('bwd',),head_blocks=8")
jobs+=("16,2048,1/16,parts=('fwd','bwd'),head_blocks=2" "64,64,1/16,parts=('fwd','bwd'),head_blocks=2")
for job in "${jobs[@]}"; do
    i=$((i + 1))
    python3 -c "import math, torch; from glm5_bridge.kernels import compile_kernels as c; c($job)" \
        > "/tmp/compile_$i.log" 2>&1 &
    pids+=($!)
done
for heads in 32 16; do  # the indexer score kernel: GLM-5 (32 × 128) and the tiny model (16 × 128)
    i=$((i + 1))
    python3 -c "from glm5_bridge.kernels import indexer; indexer.get_logits_kernel($heads, 128)" \
        > "/tmp/compile_$i.log" 2>&1 &
    pids+=($!)
done
# the token groups' unions: compile_kernels' fwd / bwd jobs above build those of 16 / 32 heads and
# the tiny model; a test's group of 8 is built here
i=$((i + 1))
python3 -c "from glm5_bridge.kernels import slot_union; slot_union.get_union_kernel(8, 2048)" > "/tmp/compile_$i.log" 2>&1 &
pids+=($!)
for topk in 2048 8 1; do  # the indexer's radix select: GLM-5, the tiny model, a test's top-1
    i=$((i + 1))
    python3 -c "from glm5_bridge.kernels import radix_topk; radix_topk.get_select_kernel($topk)" \
        > "/tmp/compile_$i.log" 2>&1 &
    pids+=($!)
done
: > "$out/compile.log"
i=0
for pid in "${pids[@]}"; do
    i=$((i + 1))
    if wait "$pid"; then echo "compile job $i ok" >> "$out/compile.log"
    else echo "compile job $i FAILED:" >> "$out/compile.log"; tail -30 "/tmp/compile_$i.log" >> "$out/compile.log"; fi
done
echo "compile: $(( $(date +%s) - start )) s" | tee -a "$out/compile.log"

# 2. The tests (tests/gpu), then 3. the timings.
python3 -m pytest tests/gpu -m gpu -rA -s -p no:cacheprovider "$@" 2>&1 | tee "$out/pytest.log"
rc=${PIPESTATUS[0]}
if [ "$bench" = 1 ]; then python3 tests/gpu/bench_sparse_mla.py 2>&1 | tee "$out/bench.log"; fi

echo
echo "== summary =="
cat "$out/compile.log"
grep -h "^RESULT" "$out/pytest.log" || true
tail -1 "$out/pytest.log"
exit "$rc"
