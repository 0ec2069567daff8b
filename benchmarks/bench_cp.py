"""DSA under context parallelism, one GPU playing each CP rank in turn (issue 40): per rank, the
time and memory of one DSA layer's attention side at GLM-5 dims against CP 1 on the same GPU.

    python3 benchmarks/bench_cp.py [--seqs 65536,131072] [--cp 1,2,4,8] [--reps 3] [--out f.json]

One sequence of S tokens. CP rank r of P holds chunks r and 2P − 1 − r of 2P
(model/attention/context_parallel.py) and runs, as in the model:
  indexer    its S/P queries (32 heads × 128) scored against all S keys, top-k 2048 as global
             flat indices (context_parallel.select_local_topk over our TileLang indexer);
  attention  sparse MLA fwd + bwd (64 heads, q/kv 576, v 512) of its queries over all S latent kv
             rows (the tilelang backend);
  gather     the layer's all-gather of the latent kv (576) and indexer key (128) rows into global
             order and the backward's reduce-scatter of dkv — here in a fake process group, so only
             the rank's local copies run; `wire_bytes` is what the collectives would receive, and
             `wire_ms_estimate` adds it at --link-gbs (an estimate, marked as such).
CP 1 runs the same parts on all S rows (no gather). Inputs are random (the same on every rank: the
gathered tensors are built whole, so no collective output is used). Checks at the first S: each
rank's top-k equals CP 1's rows (as sets) and its attention output matches CP 1's rows.

Rows (`RESULT {json}`, also written to --out): per rank ms of each part, peak GPU memory of the
layer (inputs included) and the extra over its inputs; per (S, P) a summary row with the slowest
rank against CP 1 / P (the ideal split).

Without a GPU it runs the same code at tiny dims (8 heads, top-k 8) on the unfused backend and the
torch indexer: a smoke test of the script (tests/test_bench_cp.py), not a timing.
"""

import argparse
import json
import os
import statistics
import sys
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if "glm5_bridge" not in sys.modules:  # glm5_bridge's attention and kernels without the model stack
    pkg = types.ModuleType("glm5_bridge")
    pkg.__path__ = [str(ROOT / "glm5_bridge")]
    sys.modules["glm5_bridge"] = pkg

from timing import times_ms  # noqa: E402  (benchmarks/timing.py)

from glm5_bridge.model.attention import backends, context_parallel  # noqa: E402

GIB = 2**30
# GLM-5's dims on the GPU (bf16, tilelang); tiny ones for the CPU smoke run (fp32, unfused)
GPU = dict(topk=2048, scale=1 / 16, heads=64, d_qk=576, d_v=512, i_heads=32, i_dim=128, dtype=torch.bfloat16,
           backend="tilelang")
CPU = dict(topk=8, scale=1 / 6, heads=8, d_qk=40, d_v=32, i_heads=8, i_dim=16, dtype=torch.float32, backend="megatron")


def inputs(s: int, device: str, d: dict, seed: int = 0) -> dict:
    """Global random tensors of one layer (in the dtype the model runs them)."""
    g = torch.Generator(device=device).manual_seed(seed + s)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device).to(d["dtype"])  # noqa: E731
    return dict(q=rand(s, d["heads"], d["d_qk"]), kv=rand(s, d["d_qk"]), dout=rand(s, d["heads"], d["d_v"]),
                iq=rand(s, d["i_heads"], d["i_dim"]), ik=rand(s, d["i_dim"]),
                w=torch.randn(s, d["i_heads"], generator=g, device=device) * (d["i_heads"] * d["i_dim"]) ** -0.5)


def median(fn, reps, device) -> float:
    return round(statistics.median(times_ms(fn, reps, warmup=1, device=device)), 3)


def one_rank(x: dict, s: int, parts: int, rank: int, reps: int, device: str, group, keep: bool, d: dict) -> tuple:
    """(row, outputs or None) of CP rank `rank` of `parts` (parts 1: the whole sequence, no gather);
    `keep`: return the rank's top-k and output on the host for the checks."""
    backend = backends.get_backend(d["backend"])
    select = backends.topk_selector(d["backend"])
    topk_n, scale, d_v = d["topk"], d["scale"], d["d_v"]
    cuda = device == "cuda"
    starts = torch.zeros(s, dtype=torch.int64, device=device)
    if parts > 1:
        rows = context_parallel.local_rows((s,), parts, rank, device)
        q, dout, iq, w = (x[name][rows].contiguous() for name in ("q", "dout", "iq", "w"))
    else:  # the inputs themselves (no copy: at 128K q alone is 9 GiB)
        rows = torch.arange(s, device=device)
        q, dout, iq, w = (x[name].detach() for name in ("q", "dout", "iq", "w"))
    kv = x["kv"].detach().requires_grad_()
    q.requires_grad_()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()

    def index():
        if parts == 1:
            return select(iq, x["ik"], w, starts, topk_n)
        return context_parallel.select_local_topk(select, iq, x["ik"], w, starts, rows, topk_n)

    topk = index()
    out = backend(q, kv, topk, scale, d_v, packed=True)
    out.backward(dout)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    outputs = dict(topk=topk.sort(1).values.cpu(), out=out.detach().cpu().float(), rows=rows.cpu()) if keep else None
    del out

    def step():
        q.grad = kv.grad = None
        backend(q, kv, topk, scale, d_v, packed=True).backward(dout)

    row = dict(S=s, cp=parts, rank=rank, queries=int(rows.numel()), indexer_ms=median(index, reps, device),
               attn_fwd_ms=median(lambda: backend(q, kv, topk, scale, d_v, packed=True).detach(), reps, device),
               attn_fwd_bwd_ms=median(step, reps, device))
    if parts > 1:  # the gather's local side (the fake group moves nothing): kv and indexer-key rows
        kv_local = x["kv"][rows].clone().requires_grad_()
        k_local = x["ik"][rows].contiguous()
        grad = torch.ones(s, d["d_qk"], device=device, dtype=d["dtype"])

        def gather():
            context_parallel.gather_sequence(k_local, (s,), group)
            context_parallel.gather_sequence(kv_local, (s,), group).backward(grad)
        row["gather_local_ms"] = median(gather, reps, device)
        local = s // parts
        # all-gather receives the other ranks' kv + key rows; reduce-scatter moves (P − 1)/P of dkv
        size = torch.tensor([], dtype=d["dtype"]).element_size()
        row["wire_bytes"] = (parts - 1) * local * (2 * d["d_qk"] + d["i_dim"]) * size
    row["total_ms"] = round(row["indexer_ms"] + row["attn_fwd_bwd_ms"] + row.get("gather_local_ms", 0), 3)
    if cuda:
        row.update(peak_gib=round(peak / GIB, 2), extra_gib=round((peak - base) / GIB, 2))
    return row, outputs


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="65536,131072")
    ap.add_argument("--cp", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--link-gbs", type=float, default=350.0, help="for wire_ms_estimate (NVLink-class, per direction)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "bench_cp.json"))
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_tp import each_fake_rank, precompile

    device = "cuda" if torch.cuda.is_available() else "cpu"
    d = GPU if device == "cuda" else CPU
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    if device == "cuda":
        precompile([d["heads"]])
    rows_out = []

    def emit(row):
        row = dict(device=name, **row)
        rows_out.append(row)
        print("RESULT " + json.dumps(row), flush=True)
        with open(a.out, "w") as f:
            json.dump(rows_out, f, indent=1)

    sizes = [int(p) for p in a.cp.split(",")]
    for i, s in enumerate(int(x) for x in a.seqs.split(",")):
        x = inputs(s, device, d)
        reference = None
        for parts in sizes:
            worst = None
            for _, rank, group in each_fake_rank([parts]):  # a break closes it: the group is destroyed
                try:
                    row, outputs = one_rank(x, s, parts, rank, a.reps, device, group, i == 0, d)
                except torch.OutOfMemoryError as e:
                    emit(dict(S=s, cp=parts, rank=rank, fits=False, error=str(e).split("\n")[0][:200]))
                    break
                finally:
                    if device == "cuda":
                        torch.cuda.empty_cache()
                if parts == 1 and i == 0:
                    reference = outputs
                elif reference is not None and outputs is not None:  # this rank's rows of CP 1's results
                    r = outputs["rows"]
                    row["same_topk"] = bool(torch.equal(outputs["topk"], reference["topk"][r]))
                    ref = reference["out"][r]
                    row["out_vs_cp1_rel"] = round(((outputs["out"] - ref).norm() / ref.norm()).item(), 6)
                emit(row)
                worst = row if worst is None or row["total_ms"] > worst["total_ms"] else worst
            if worst is not None and parts > 1:
                base = next((r for r in rows_out if r.get("S") == s and r.get("cp") == 1 and "total_ms" in r), None)
                wire_ms = worst["wire_bytes"] / (a.link_gbs * 1e9) * 1e3
                peaks = [r["peak_gib"] for r in rows_out if (r.get("S"), r.get("cp")) == (s, parts) and "peak_gib" in r]
                summary = dict(kind="summary", S=s, cp=parts, slowest_rank_ms=worst["total_ms"],
                               peak_gib=max(peaks, default=None), wire_ms_estimate=round(wire_ms, 3),
                               link_gbs=a.link_gbs)
                if base:
                    summary.update(cp1_ms=base["total_ms"], cp1_peak_gib=base.get("peak_gib"),
                                   speedup_vs_cp1=round(base["total_ms"] / worst["total_ms"], 2),
                                   efficiency=round(base["total_ms"] / (parts * worst["total_ms"]), 3))
                emit(summary)
        del x
        reference = None
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
