"""Is the 64-head backward at the floor of its own memory traffic? (benchmarks/LOG.md, "Run AO")

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/bench_bwd_floor.py [--out $OUT/bench_bwd_floor.json]

`traffic_kernel(gather, adds)` runs the fused backward's memory traffic without its GEMMs: one CTA
per token, 256 threads, 64-key blocks over the token's active slots in a one-stage pipeline, the
same shared-memory footprint (one CTA per SM), the same gather (latent + rope of 64 keys by index)
and the same DKV_ADD calls (4 × 128 latent channels + 64 rope) from a fragment filled from the
gathered keys. gather=False: the adds alone ("adds_only_1cta"; "adds_only" is
sparse_mla_bwd.dkv_adds_kernel at free occupancy); adds=False: the gathers alone (the adds behind
the never-true first_added bound, as fused_kernel(adds=False)). One process, against the
committed fused kernel and "fused_no_adds", on bench_dsa's bwd_parts inputs (S = 8K, 16K, H = 64,
random causal used-first slots, top-k 2048). Prints one RESULT line per row; --out gets them all.
An experiment's kernel, not a backward: its dkv is meaningless.
"""
import json
import os
import sys

from glm5_bridge.kernels import sparse_mla_bwd as B, sparse_mla_fwd as F
from glm5_bridge.kernels._tilelang import compile_kernel, tl


def traffic_kernel(gather: bool, adds: bool, topk: int = 2048, cols: int = 128):
    tilelang, T = tl()
    block_i, f32, bf = 64, T.float32, T.bfloat16
    n, nkv = T.dynamic("num_tokens"), T.dynamic("num_kv")
    first_added = 0 if adds else 2**30

    @T.prim_func
    def main(Q: T.Tensor([n, 64, 576], bf), KV: T.Tensor([nkv, 576], bf), Idx: T.Tensor([n, topk], T.int32),
             Cnt: T.Tensor([n], T.int32), dKV: T.Tensor([nkv, 576], f32)):
        with T.Kernel(n, threads=256, prelude=B.DKV_ADD) as t:
            q_s = T.alloc_shared([64, 512], bf)  # Q and dO's 136 KB: one CTA per SM as the fused kernel
            do_s = T.alloc_shared([64, 512], bf)
            qt_s = T.alloc_shared([64, 64], bf)
            k_s = T.alloc_shared([block_i, 512], bf)
            kt_s = T.alloc_shared([block_i, 64], bf)
            acc_kv = T.alloc_fragment([block_i, cols], f32)
            acc_kvt = T.alloc_fragment([block_i, 64], f32)
            T.copy(Q[t, :, 0:512], q_s)
            T.copy(Q[t, :, 0:512], do_s)
            T.copy(Q[t, :, 512:576], qt_s)
            if not gather:
                T.clear(k_s)
                T.clear(kt_s)
            for i in T.Pipelined(T.ceildiv(Cnt[t], block_i), num_stages=1):
                if gather:
                    for r, d in T.Parallel(block_i, 512):
                        k_s[r, d] = KV[T.max(Idx[t, i * block_i + r], 0), d]
                    for r, d in T.Parallel(block_i, 64):
                        kt_s[r, d] = KV[T.max(Idx[t, i * block_i + r], 0), 512 + d]
                for cc in T.serial(512 // cols):
                    for r, c in T.Parallel(block_i, cols):
                        acc_kv[r, c] = T.cast(k_s[r, cc * cols + c], f32) * T.cast(do_s[r, cc * cols + c], f32)
                    T.call_extern("handle", f"glm5_dkv_add<{cols}>", acc_kv.data, T.address_of(Idx[t, i * block_i]),
                                  T.address_of(dKV[0, cc * cols]), first_added, nkv)
                for r, c in T.Parallel(block_i, 64):
                    acc_kvt[r, c] = T.cast(kt_s[r, c], f32) * T.cast(qt_s[r, c], f32)
                T.call_extern("handle", "glm5_dkv_add<64>", acc_kvt.data, T.address_of(Idx[t, i * block_i]),
                              T.address_of(dKV[0, 512]), first_added, nkv)

    return compile_kernel(main, out_idx=[])


def main():
    import argparse

    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_dsa as bd

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "bench_bwd_floor.json"))
    out_path = ap.parse_args().out

    traffic = {"gathers_and_adds": traffic_kernel(True, True), "gathers_only": traffic_kernel(True, False),
               "adds_only_1cta": traffic_kernel(False, True)}
    variants = bd.bwd_variants(64)
    rows = []
    for s in (8192, 16384):
        gen = torch.Generator(device="cuda").manual_seed(s)
        q = torch.randn(s, 64, 576, device="cuda", generator=gen).bfloat16()
        kv = torch.randn(s, 576, device="cuda", generator=gen).bfloat16()
        idx = bd.used_first(bd.causal_topk([s], 2048, gen))
        cnt = F.active_slots(idx)
        dout = torch.randn(s, 64, 512, device="cuda", generator=gen).bfloat16()
        out, lse = F.fwd(q, kv, idx, 1 / 16, cnt)
        delta = (out.float() * dout.float()).sum(-1)
        used = int((idx >= 0).sum())
        gather_gb, add_gb = used * 576 * 2 / 1e9, used * 576 * 4 / 1e9
        runs = {name: (lambda run=run: run(q, kv, dout, idx, cnt, lse, delta)) for name, run in variants.items()}
        for name, k in traffic.items():
            def run(k=k):
                dkv = torch.zeros(kv.shape, dtype=torch.float32, device="cuda")
                k(q, kv, idx, cnt, dkv)
            runs[name] = run
        for name, run in runs.items():
            t, sp = bd.median_ms(run, 7)
            row = dict(variant=name, S=s, H=64, ms=round(t, 3), spread=round(sp, 3), gather_gb=round(gather_gb, 2),
                       add_gb=round(add_gb, 2), **bd.rates(bd.sparse_flops(s, 64)[1], t, bd.useful_share(idx)))
            print("RESULT", json.dumps(row), flush=True)
            rows.append(row)
        del q, kv, idx, cnt, dout, out, lse, delta
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
