"""DSA under tensor parallelism, in one run on P GPUs (torchrun), each part against its baseline:

  indexer    top-k of GLM-5's indexer (32 heads × 128, top-k 2048), our score kernel + radix select:
             "replicated" (every rank scores all T rows: megatron-core replicates the indexer) against
             "split" (attention/topk.select_topk_split: 2 of 2P row chunks per rank, then an
             all-gather of the int32 top-k);
  attention  sparse MLA fwd + bwd at GLM-5 dims (64 heads in all, q/kv 576, v 512, random causal
             top-k 2048) on the "tilelang" backend: "heads_split" (megatron's layout: each rank its
             64/P heads over all T tokens) against "tokens_split" (attention/token_parallel.attend:
             all heads of 1/P of the tokens, two all-to-alls each way).

    torchrun --nproc-per-node 8 benchmarks/bench_tp.py [--parts indexer,attention] [--seqs 8192,16384] [--out f.json]

Same random inputs on every rank (seeded). Rank 0 prints one `RESULT {json}` line per (part, S,
variant) and writes them to --out: per repetition the slowest rank's time (a TP layer waits for it),
then the median and spread over repetitions. Checks: `same_topk` (split = replicated), and for the
attention the largest relative difference of the tokens-split output from the heads-split one.
Without a GPU it runs on the CPU over gloo (torch indexer, unfused attention at small dims): a smoke
test of the script, not a timing.
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

from glm5_bridge.attention import backends, token_parallel  # noqa: E402
from glm5_bridge.attention.topk import select_topk_split  # noqa: E402
from glm5_bridge.kernels import indexer  # noqa: E402
from glm5_bridge.kernels.reference import random_causal_topk  # noqa: E402

TOPK, SCALE = 2048, 1 / 16


def timed(fn, reps, device, group):
    """Median and spread over repetitions of the slowest rank's time."""
    t = torch.tensor(times_ms(fn, reps, device=device), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    t = t.tolist()
    return round(statistics.median(t), 3), round(max(t) - min(t), 3)


def bench_indexer(s, device, group, reps):
    heads, dim = 32, 128
    gen = torch.Generator(device=device).manual_seed(s)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(s, heads, dim, device=device, generator=gen).to(dtype)
    k = torch.randn(s, dim, device=device, generator=gen).to(dtype)
    w = torch.randn(s, heads, device=device, generator=gen) * (heads ** -0.5 * dim ** -0.5)
    starts = torch.zeros(s, dtype=torch.int64, device=device)
    variants = {"replicated": lambda: indexer.select_topk(q, k, w, starts, TOPK),
                "split": lambda: select_topk_split(indexer.select_topk, q, k, w, starts, TOPK, group)}
    same = torch.equal(*(v().sort(1).values for v in variants.values()))
    for name, fn in variants.items():
        ms, spread = timed(fn, reps, device, group)
        yield dict(part="indexer", impl=name, S=s, heads=heads, dim=dim, ms=ms, spread_ms=spread, same_topk=same)


def bench_attention(s, device, group, reps):
    parts, rank = group.size(), group.rank()
    heads, d, v = (64, 576, 512) if device == "cuda" else (4 * parts, 40, 32)
    backend = backends.get_backend("tilelang" if device == "cuda" else "megatron")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(s)
    q_all = torch.randn(s, heads, d, device=device, generator=gen).to(dtype)
    kv = torch.randn(s, d, device=device, generator=gen).to(dtype).requires_grad_()
    dout_all = torch.randn(s, heads, v, device=device, generator=gen).to(dtype)
    topk = random_causal_topk([s], TOPK, device=device, generator=gen)
    mine = slice(rank * heads // parts, (rank + 1) * heads // parts)
    q, dout = q_all[:, mine].contiguous().requires_grad_(), dout_all[:, mine].contiguous()

    def heads_split():
        return backend(q, kv, topk, SCALE, v, packed=True)

    def tokens_split():
        return token_parallel.attend(backend, q, kv, topk, SCALE, v, packed=True, group=group)

    outs = {}
    for name, fn in (("heads_split", heads_split), ("tokens_split", tokens_split)):
        outs[name] = fn().detach().float()

        def step(fn=fn):
            q.grad = kv.grad = None
            fn().backward(dout)

        fwd_ms, fwd_spread = timed(lambda fn=fn: fn().detach(), reps, device, group)
        step_ms, step_spread = timed(step, reps, device, group)
        yield dict(part="attention", impl=name, S=s, heads=heads, heads_per_rank=heads // parts, fwd_ms=fwd_ms,
                   fwd_spread_ms=fwd_spread, fwd_bwd_ms=step_ms, fwd_bwd_spread_ms=step_spread)
    diff = (outs["tokens_split"] - outs["heads_split"]).norm() / outs["heads_split"].norm()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
    yield dict(part="attention_check", S=s, tokens_vs_heads_split_rel=round(diff.item(), 6))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="indexer,attention")
    ap.add_argument("--seqs", default="8192,16384")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "bench_tp.json"))
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    group = dist.group.WORLD
    rows = []
    for s in (int(x) for x in a.seqs.split(",")):
        for part in a.parts.split(","):
            for row in {"indexer": bench_indexer, "attention": bench_attention}[part](s, device, group, a.reps):
                row = dict(kind="bench_tp", tp=group.size(), device=device, **row)
                rows.append(row)
                if group.rank() == 0:
                    print("RESULT " + json.dumps(row), flush=True)
    if group.rank() == 0:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
