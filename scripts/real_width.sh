#!/usr/bin/env bash
# GLM-5.2 at real width on one GPU, end to end through the CLI (benchmarks/real_width.py says what
# each step measures). Usage, on a CUDA machine:
#   bash scripts/real_width.sh [--steps slice,convert,…] [real_width.py options]
# Results: benchmarks/results/real_width_<gpu>_<date>.json (or --out); scratch in $RW_WORK
# (default /tmp/real_width, ~45 GB at the peak); logs in $RW_WORK/logs. On the lent device machine,
# which has no megatron-core / tilelang, the packed site (scripts/device_site.sh) is unpacked first:
#   run, carry [".site"]: bash scripts/real_width.sh --out $OUT/real_width.json
set -euo pipefail
cd "$(dirname "$0")/.."
work=${RW_WORK:-/tmp/real_width}
mkdir -p "$work/logs"
if ! python3 -c "import megatron.core, tilelang" 2>/dev/null; then
    [ -f .site/site.tar.xz ] || { echo "megatron-core / tilelang missing and no .site/site.tar.xz"; exit 1; }
    [ -f /tmp/site/.unpacked ] || { mkdir -p /tmp/site && tar -C /tmp/site -xJf .site/site.tar.xz && touch /tmp/site/.unpacked; }
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
source scripts/modelopt_standin.sh  # megatron-bridge's HF writer imports nvidia-modelopt; the site has none
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1])")
out=benchmarks/results/real_width_${gpu}_$(date +%F).json
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$work/logs/gpu.txt"

# TileLang kernels at GLM-5.2's shapes (64 heads, top-k 2048, scale 1/16; indexer 32 × 128), one
# process each, in the background while the checkpoint is made and converted: the training
# processes then load them from TileLang's disk cache instead of compiling one after another.
jobs=("64,2048,1/16,parts=('fwd',)" "64,2048,1/16,parts=('bwd','delta')" "64,2048,1/16,parts=('slots',)"
      "64,2048,1/16,kernels='upstream'")
for job in "${jobs[@]}"; do
    python3 -c "import torch; from glm5_bridge.kernels import compile_kernels as c; c($job)" >> "$work/logs/compile.log" 2>&1 &
done
python3 -c "from glm5_bridge.kernels import indexer; indexer.get_logits_kernel(32, 128)" >> "$work/logs/compile.log" 2>&1 &
python3 -c "from glm5_bridge.kernels import radix_topk; radix_topk.get_select_kernel(2048)" >> "$work/logs/compile.log" 2>&1 &

python3 benchmarks/real_width.py --work "$work" --out "$out" "$@"
wait
