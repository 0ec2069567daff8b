"""The lightning indexer's top-k under tensor parallelism, in one run on P GPUs:
  replicated  every rank scores all T query rows: megatron-core replicates the indexer, and this is
              what SparseMLACoreAttention ran before attention/topk.select_topk_split;
  split       select_topk_split: each rank scores 2 of 2P row chunks, then the int32 top-k is
              all-gathered, so every rank ends with the same [T, top-k].
Both run our score kernel + radix select (kernels/indexer.select_topk) on one causal sequence with
GLM-5's indexer shape (32 heads × 128, top-k 2048), the same random bf16 inputs on every rank.

    torchrun --nproc-per-node 8 benchmarks/bench_indexer_tp.py [--seqs 8192,16384,32768] [--out f.json]

Rank 0 prints one `RESULT {json}` line per (S, variant) and writes them to --out: per repetition
the slowest rank's time (a TP layer waits for it), then the median and spread over repetitions;
`same_topk` says whether split and replicated selected the same keys. Without a GPU it runs on the
CPU over gloo with the torch selection (a smoke test of the script, not a timing).
"""

import argparse
import json
import os
import statistics
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if "glm5_bridge" not in sys.modules:  # load glm5_bridge's attention and kernels without the model stack
    pkg = types.ModuleType("glm5_bridge")
    pkg.__path__ = [str(ROOT / "glm5_bridge")]
    sys.modules["glm5_bridge"] = pkg

from timing import times_ms  # noqa: E402  (benchmarks/timing.py)

from glm5_bridge.attention.topk import select_topk_split  # noqa: E402
from glm5_bridge.kernels import indexer  # noqa: E402

HEADS, DIM, TOPK = 32, 128, 2048


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="8192,16384,32768")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "indexer_tp.json"))
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank, parts, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for s in (int(x) for x in a.seqs.split(",")):
        gen = torch.Generator(device=device).manual_seed(s)
        q = torch.randn(s, HEADS, DIM, device=device, generator=gen).to(dtype)
        k = torch.randn(s, DIM, device=device, generator=gen).to(dtype)
        w = torch.randn(s, HEADS, device=device, generator=gen) * (HEADS ** -0.5 * DIM ** -0.5)
        starts = torch.zeros(s, dtype=torch.int64, device=device)
        variants = {"replicated": lambda: indexer.select_topk(q, k, w, starts, TOPK),
                    "split": lambda: select_topk_split(indexer.select_topk, q, k, w, starts, TOPK, group)}
        same = torch.equal(*(v().sort(1).values for v in variants.values()))
        for name, fn in variants.items():
            t = torch.tensor(times_ms(fn, a.reps, device=device), device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # per repetition, the slowest rank
            t = t.tolist()
            row = dict(kind="indexer_tp", impl=name, S=s, tp=parts, heads=HEADS, dim=DIM, topk=TOPK, device=device,
                       ms=round(statistics.median(t), 3), spread_ms=round(max(t) - min(t), 3), same_topk=same)
            rows.append(row)
            if rank == 0:
                print("RESULT " + json.dumps(row), flush=True)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
