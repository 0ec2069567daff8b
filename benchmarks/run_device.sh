#!/usr/bin/env bash
# On the device machine (H100 or H200), with the packages of benchmarks/README.md on PYTHONPATH:
#   export PYTHONPATH=/tmp/site:$PWD && bash benchmarks/run_device.sh [bench_dsa.py args...]
# 1. builds every kernel the benchmark uses, one process each, in parallel (TileLang's disk cache
#    then serves the benchmark), 2. runs benchmarks/bench_dsa.py. Logs and JSON go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/bench_dsa}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv | tee "$out/gpu.txt"
start=$(date +%s)
pre='import sys, types; p = types.ModuleType("glm5_bridge"); p.__path__ = ["glm5_bridge"]; sys.modules["glm5_bridge"] = p; sys.path.insert(0, "benchmarks")
from glm5_bridge.kernels import sparse_mla_fwd as F, sparse_mla_bwd as B
from glm5_bridge.kernels import ops as S
from megatron.core.transformer.experimental_attention_variant.ops import tilelang_sparse_mla_fwd as uf, tilelang_sparse_mla_bwd as ub
from megatron.core.transformer.experimental_attention_variant.ops import tilelang_indexer_fwd as ui'
jobs=(
  "F.get_kernel(64, 2048, 1/16)"
  "F.get_kernel(16, 2048, 1/16)"
  "B.get_fused_kernel(64, 2048, 1/16, 'bfloat16')"
  "B.fused_kernel(64, 2048, 1/16, 'bfloat16', adds=False); B.dkv_adds_kernel(2048)"
  "B.get_delta_kernel(64, 'bfloat16'); B.get_delta_kernel(16, 'bfloat16')"
  "B.get_fused_kernel(16, 2048, 1/16, 'bfloat16')"
  "B.fused_kernel(16, 2048, 1/16, 'bfloat16', adds=False)"
  "B.fused_kernel(16, 2048, 1/16, 'bfloat16', group=1)"
  "from glm5_bridge.kernels import slot_union; slot_union.get_union_kernel(4, 2048)"
  "import bench_dsa; bench_dsa.simple_fwd(64, skip_empty=False); bench_dsa.simple_fwd(16, skip_empty=False)"
  "import bench_dsa; bench_dsa.simple_fwd(16); bench_dsa.simple_fwd(16, 4)"
  "S.compile_kernels(64, 2048, 1/16, parts=('fwd',), kernels='upstream')"
  "S.compile_kernels(64, 2048, 1/16, parts=('bwd',), kernels='upstream')"
  "S.compile_kernels(16, 2048, 1/16, parts=('fwd',), kernels='upstream')"
  "S.compile_kernels(16, 2048, 1/16, parts=('bwd',), kernels='upstream')"
  "S.compile_kernels(64, 2048, 1/16, parts=('delta',), kernels='upstream'); S.compile_kernels(16, 2048, 1/16, parts=('delta', 'post'), kernels='upstream')"
  "S.compile_kernels(64, 2048, 1/16, parts=('slots',))"
  "ui._get_indexer_fwd_kernel(32, 128); ui._get_clean_logits_kernel()"
  "from glm5_bridge.kernels import indexer as I; I.get_logits_kernel(32, 128)"
  "from glm5_bridge.kernels import radix_topk as R; R.get_select_kernel(2048)"
  "S.compile_kernels(8, 2048, 1/16, parts=('fwd', 'delta'))"
  "S.compile_kernels(8, 2048, 1/16, parts=('bwd',))"
  "S.compile_kernels(16, 2048, 1/16, parts=('bwd', 'delta'))"
  "S.compile_kernels(64, 2048, 1/16, parts=('fwd', 'bwd'), head_blocks=2)"  # the tp part's tokens_split_in_place
  "S.compile_kernels(64, 2048, 1/16, parts=('fwd', 'bwd'), head_blocks=4)"
  "S.compile_kernels(64, 2048, 1/16, parts=('fwd', 'bwd'), head_blocks=8)"
)
pids=()
i=0
for job in "${jobs[@]}"; do
  i=$((i + 1))
  timeout 300 python3 -c "$pre
$job" > "$out/compile_$i.log" 2>&1 &
  pids+=($!)
done
i=0
for pid in "${pids[@]}"; do
  i=$((i + 1))
  if wait "$pid"; then echo "compile $i ok: ${jobs[$((i - 1))]}"; else echo "compile $i FAILED: ${jobs[$((i - 1))]}"; tail -25 "$out/compile_$i.log"; fi
done > "$out/compile.txt"; cat "$out/compile.txt"
echo "compile: $(( $(date +%s) - start )) s" | tee -a "$out/compile.txt"
timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/bench_dsa.py --out "$out/bench_dsa.json" "$@" 2>&1 | tee "$out/bench.log"
