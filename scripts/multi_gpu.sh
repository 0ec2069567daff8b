#!/usr/bin/env bash
# Issue 8 on GPUs: TP=2 + sequence parallel with LoRA training, EP=2, PP=2 with IndexShare stage
# boundaries, and HF ⇄ Megatron conversion into and out of TP/EP/PP shards, each checked against the
# single-rank model. The cases and checks are tests/test_parallel.py's (CI runs them on CPU with 2
# gloo processes); here torchrun starts one process per GPU and they use NCCL. It runs them on 2 GPUs,
# then on 4 (TP, EP and PP of 2 with data parallel 2 beside them).
#
# NOT RUN YET. The multi-GPU machines (nvidia-h200-x2 / -x4) were withheld in the session that
# wrote this script, so it has never run on GPUs. Only its CPU form ran: on a machine without CUDA
# the same torchrun command uses gloo (`.venv/bin/torchrun --nproc-per-node 2 tests/test_parallel.py`,
# all 7 checks pass; docs/parallel.md).
#
# On an nvidia-h200-x4 (or -x2 with `bash scripts/multi_gpu.sh 2`), with the wheels of
# ../shared/device/wheels.sh (megatron-core 0.19.2, megatron-bridge 0.6.2, transformers 5.23; no
# tilelang needed), two calls on the same warm machine:
#   run 1, carry [".whl-a"]: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-a/*.whl
#   run 2, carry [".whl-b"]: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-b/*.whl \
#                             && PYTHONPATH=/tmp/site:$PWD bash scripts/multi_gpu.sh
# Usage: bash scripts/multi_gpu.sh [N ...]   (process counts, default "2 4"; each N ≤ the GPUs there)
# Logs go to $OUT (default /tmp/multi_gpu): gpu.txt, torchrun_N.log (PASS / FAIL / RESULT lines).
# Exit status: non-zero when any run failed or a count needs more GPUs than there are.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/multi_gpu}
mkdir -p "$out"
counts=("$@")
[ ${#counts[@]} -eq 0 ] && counts=(2 4)

# NVLink multicast stays off on the shared hosts (KINDS.md): a program that uses it can take the
# host's GPUs out of service. torchrun's workers inherit these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
py=${PYTHON:-python3}

nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv | tee "$out/gpu.txt"
"$py" -c "import glm5_bridge, torch, megatron.core, transformers; print('torch', torch.__version__, \
'| cuda devices', torch.cuda.device_count(), '| megatron-core', megatron.core.__version__, \
'| transformers', transformers.__version__)" 2>/dev/null | tail -1 | tee -a "$out/gpu.txt"
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null | tail -1)

rc=0
for n in "${counts[@]}"; do
    if [ "${gpus:-0}" -lt "$n" ]; then
        echo "== $n processes: only ${gpus:-0} GPUs, not run" | tee "$out/torchrun_$n.log"
        rc=1
        continue
    fi
    echo "== $n processes (one GPU each, NCCL)"
    start=$(date +%s)
    "$py" -m torch.distributed.run --standalone --nproc-per-node "$n" tests/test_parallel.py \
        > "$out/torchrun_$n.log" 2>&1
    status=$?
    grep -E "^(RESULT|PASS|FAIL|[a-z]+ case:)" "$out/torchrun_$n.log"
    echo "exit $status, $(( $(date +%s) - start )) s"
    if [ "$status" -ne 0 ]; then
        rc=1
        tail -40 "$out/torchrun_$n.log"
    fi
done
exit "$rc"
