"""Sparse MLA on top-k sets that neighbouring queries share: how our kernels and upstream's
respond to the locality a trained indexer has and bench_dsa.py's random top-k lacks.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/bench_locality.py [--seqs 8192] [--heads 16,64]
        [--churn 1,0.5,0.2,0.05] [--out $OUT/bench_locality.json]

Top-k model ("sticky", `sticky_topk`): row t < K takes its whole causal window; row t ≥ K is row
t − 1 with round(churn · K) of its slots redrawn uniformly from the keys of [0, t] it does not
keep. Neighbouring rows then share about (1 − churn) · K keys; churn = 1 draws every row afresh,
which is bench_dsa's random top-k (neighbours share ≈ K / t by chance). Recorded top-k (R3
payloads of a real model) were not available here: the churn values bracket them.

Why it matters: the backward adds one fp32 dKV row per (CTA, distinct key), so below 64 heads,
where a CTA serves 64 / H neighbouring tokens over the union of their slots (slot_union.py), the
adds and gathers shrink with the union; at 64 heads (one token per CTA) only cache hits change.
Per (S, churn) the JSON has the measured neighbour overlap and the mean union of a token group
over group · K; per H our and upstream's forward and backward (ms, TFLOP/s over all K slots, as
bench_dsa.py counts them), all in one process.
"""

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_dsa as B  # noqa: E402  (sets up glm5_bridge.kernels without the model stack)

def sticky_topk(s: int, k: int, churn: float, seed: int = 0) -> torch.Tensor:
    """[s, k] int32 causal top-k, used slots first, −1 after (see the module docstring)."""
    if not 0 <= churn <= 1:
        raise ValueError(f"churn must lie in [0, 1]; got {churn}")
    rng = np.random.default_rng(seed)
    out = np.full((s, k), -1, dtype=np.int32)
    for t in range(min(k, s)):
        out[t, :t + 1] = np.arange(t + 1)
    sel = np.arange(k, dtype=np.int64)  # row k − 1's keys, in slot order
    kept = np.zeros(s, dtype=bool)
    kept[:k] = True
    n = round(churn * k)
    for t in range(k, s):
        slots = rng.choice(k, n, replace=False)
        kept[sel[slots]] = False
        new = rng.choice(np.flatnonzero(~kept[:t + 1]), n, replace=False)  # a dropped key may come back
        kept[new] = True
        sel[slots] = new
        out[t] = sel
    return torch.from_numpy(out)


def locality(idx: torch.Tensor, group: int) -> dict:
    """Mean shared keys of neighbouring rows / K (rows ≥ K) and mean distinct keys of a group of
    `group` consecutive rows / (group · K) (groups of rows ≥ K)."""
    x = idx.numpy()
    k = x.shape[1]
    full = x[k:]
    if len(full) < group + 1:
        return {}
    a, b = np.sort(full[:-1], axis=1), np.sort(full[1:], axis=1)
    shared = [np.intersect1d(p, q, assume_unique=True).size for p, q in zip(a[::64], b[::64])]
    groups = full[:len(full) // group * group].reshape(-1, group * k)[::16]
    union = [np.unique(g).size for g in groups]
    return dict(neighbour_shared=round(float(np.mean(shared)) / k, 4),
                group_union=round(float(np.mean(union)) / (group * k), 4))


def recorded_locality(rollouts: str, config: str, groups: list[int]) -> None:
    """`locality` of each rollout's recorded top-k, per computing layer (rows ≥ K)."""
    import json

    from transformers import AutoConfig

    from glm5_bridge.model.payload import ReplayLayout, RequestTopk

    layout = ReplayLayout.from_hf_config(AutoConfig.from_pretrained(config))
    with open(rollouts) as f:
        for i, line in enumerate(f):
            row = json.loads(line)
            topk = RequestTopk.from_sglang(row["meta_info"], layout, len(row["tokens"]), sample_id=str(i))
            for slot, layer in enumerate(layout.computing):
                idx = topk.layer(slot)
                k = idx.shape[1]  # the neighbour pairs `locality` samples: rows k + j and k + j + 1
                chance = np.mean([k / (k + j + 2) for j in range(0, idx.shape[0] - k - 1, 64)])
                B.emit("recorded", rollout=i, layer=layer, rows=idx.shape[0], chance_shared=round(float(chance), 4),
                       **{f"group{g}": locality(idx, g) for g in groups})


def bench(s, heads, churn, idx, reps):
    fwd_mod, bwd_mod = B.upstream_mods()
    gen = torch.Generator(device="cuda").manual_seed(s + heads)
    q = torch.randn(s, heads, 576, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(s, 576, device="cuda", generator=gen).bfloat16()
    dout = torch.randn(s, heads, 512, device="cuda", generator=gen).bfloat16()
    idx = idx.cuda()
    f_fl, b_fl = B.sparse_flops(s, heads)
    row = dict(S=s, H=heads, churn=churn)

    of, ob, o = B.ours_calls(q, kv, dout, idx)  # the raw kernels, as bench_dsa's "ours" rows
    uf, ub, o_up = B.upstream_calls(fwd_mod, bwd_mod, q, kv, dout, idx)
    tf, _ = B.median_ms(of, reps)
    tb, _ = B.median_ms(ob, max(3, reps // 2))
    uf_ms, _ = B.median_ms(uf, reps)
    ub_ms, _ = B.median_ms(ub, max(3, reps // 2))
    useful = B.useful_share(idx)
    B.emit("locality", **row, ours_fwd_ms=round(tf, 3), **B.rates(f_fl, tf, useful, "ours_fwd_"),
         ours_bwd_ms=round(tb, 3), **B.rates(b_fl, tb, useful, "ours_bwd_"),
         upstream_fwd_ms=round(uf_ms, 3), upstream_bwd_ms=round(ub_ms, 3),
         **B.rates(b_fl, ub_ms, useful, "upstream_bwd_"), out_vs_upstream=B.rel(o, o_up))
    del q, kv, dout, o, o_up, of, ob, uf, ub
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="8192")
    ap.add_argument("--heads", default="16,64")
    ap.add_argument("--churn", default="1,0.5,0.2,0.05")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "bench_locality.json"))
    ap.add_argument("--recorded", help="a rollout file with meta_info.indexer_topk: its locality only")
    ap.add_argument("--config", help="with --recorded: the checkpoint folder whose config.json it follows")
    a = ap.parse_args()
    B.OUT_PATH = a.out  # B.emit prints each row and rewrites this file with all of them
    if a.recorded:
        return recorded_locality(a.recorded, a.config, [1, 2, 4, 8])
    print("device", torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    heads_list = [int(h) for h in a.heads.split(",")]
    for s in (int(x) for x in a.seqs.split(",")):
        for churn in (float(c) for c in a.churn.split(",")):
            idx = sticky_topk(s, B.TOPK, churn)
            groups = sorted({B.slot_union.token_group(h) for h in heads_list} | {4})
            B.emit("topk", S=s, churn=churn, **{f"group{g}": locality(idx, g) for g in groups})
            for heads in heads_list:
                bench(s, heads, churn, idx, a.reps)


if __name__ == "__main__":
    main()
