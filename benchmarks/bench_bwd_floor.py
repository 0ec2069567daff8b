"""Is the 64-head backward at the floor of its own memory traffic? (benchmarks/LOG.md, "Run AO")

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/bench_bwd_floor.py [--out $OUT/bench_bwd_floor.json]

`traffic_kernel(gather, adds)` runs the fused backward's memory traffic without its GEMMs: one CTA
per token, 256 threads, 64-key blocks over the token's active slots in a one-stage pipeline, the
same shared-memory footprint (one CTA per SM), the same gather (latent + rope of 64 keys by index)
and the same DKV_ADD calls (4 × 128 latent channels + 64 rope) from a fragment filled from the
gathered keys. gather=False: the adds alone ("adds_only_1cta"; "adds_only" is
sparse_mla_bwd.dkv_adds_kernel at free occupancy); adds=False: the gathers alone (the adds behind
the never-true first_added bound, as fused_kernel(adds=False)). `bulk_adds_kernel`: the same adds
as sm_90 bulk reductions from shared memory ("adds_bulk_2304B", "adds_bulk_256B"; not yet run).
One process, against the committed fused kernel and "fused_no_adds", on bench_dsa's bwd_parts inputs (S = 8K, 16K, H = 64,
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


# sm_90's bulk reduction (PTX ISA 8.0): `cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32
# [dst], [src], bytes` adds a contiguous range of shared memory into global memory, carried out
# asynchronously by the TMA unit. Op o of a block's 64 · per_row ops adds bytes [c·B, (c+1)·B) of
# staged row r = o % 64 (B = 2304 / per_row) into dkv row idx[r]; the CTA's threads take the ops in
# turn, each commits its group. fence.proxy.async makes the threads' shared-memory writes visible to
# the async proxy; wait_group.read 0 lets a later block overwrite the stage.
BULK_ADD = r"""
template <int PER_ROW>
__device__ __forceinline__ void glm5_bulk_add(const float* stage, const int* idx, float* dkv, int num_kv) {
  constexpr int FLOATS = 576 / PER_ROW;
  for (int o = threadIdx.x; o < 64 * PER_ROW; o += blockDim.x) {
    const int r = o % 64, c = o / 64, row = idx[r];
    if (row >= 0 && row < num_kv) {
      const unsigned src = static_cast<unsigned>(__cvta_generic_to_shared(stage + r * 576 + c * FLOATS));
      asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                   :: "l"(dkv + (long long)row * 576 + c * FLOATS), "r"(src), "r"(FLOATS * 4) : "memory");
    }
  }
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
__device__ __forceinline__ void glm5_bulk_wait() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void glm5_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
"""


def bulk_adds_kernel(per_row: int, topk: int = 2048):
    """The adds of `sparse_mla_bwd.dkv_adds_kernel` (a constant 1 per selected key and channel) as
    bulk reductions from a [64, 576] fp32 tile staged in shared memory (147 KB: one CTA per SM), each
    row in `per_row` ops (1: one of 2304 B; 9: nine of 256 B), one wait per block, as a kernel would
    before overwriting the stage. Against "adds_only" / "adds_only_1cta" (16-byte REDs from registers):
    do the TMA unit's adds go faster, or is the L2's adding the limit either way? Its dkv must equal
    the RED kernel's (exact counts)."""
    tilelang, T = tl()
    assert 576 % per_row == 0 and (576 // per_row * 4) % 16 == 0
    block_i, f32 = 64, T.float32
    n, nkv = T.dynamic("num_tokens"), T.dynamic("num_kv")

    @T.prim_func
    def main(Idx: T.Tensor([n, topk], T.int32), Cnt: T.Tensor([n], T.int32), dKV: T.Tensor([nkv, 576], f32)):
        with T.Kernel(n, threads=256, prelude=BULK_ADD) as t:
            stage = T.alloc_shared([block_i, 576], f32)
            T.fill(stage, 1.0)
            T.call_extern("handle", "glm5_proxy_fence")  # each writer, before the barrier the issuers pass
            T.sync_threads()
            for i in T.serial(T.ceildiv(Cnt[t], block_i)):
                T.call_extern("handle", f"glm5_bulk_add<{per_row}>", T.address_of(stage[0, 0]),
                              T.address_of(Idx[t, i * block_i]), T.address_of(dKV[0, 0]), nkv)
                T.call_extern("handle", "glm5_bulk_wait")

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
    bulk = {"adds_bulk_2304B": bulk_adds_kernel(1), "adds_bulk_256B": bulk_adds_kernel(9)}
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
        useful, red_dkv = bd.useful_share(idx), None  # red_dkv: the 16-byte REDs' counts, once
        runs = {name: (lambda run=run: run(q, kv, dout, idx, cnt, lse, delta)) for name, run in variants.items()}
        for name, k in traffic.items():
            def run(k=k):
                dkv = torch.zeros(kv.shape, dtype=torch.float32, device="cuda")
                k(q, kv, idx, cnt, dkv)
            runs[name] = run
        for name, k in bulk.items():
            def run(k=k):
                dkv = torch.zeros(kv.shape, dtype=torch.float32, device="cuda")
                k(idx, cnt, dkv)
                return dkv
            runs[name] = run
        for name, run in runs.items():
            t, sp = bd.median_ms(run, 7)
            row = dict(variant=name, S=s, H=64, ms=round(t, 3), spread=round(sp, 3), gather_gb=round(gather_gb, 2),
                       add_gb=round(add_gb, 2), **bd.rates(bd.sparse_flops(s, 64)[1], t, useful))
            if name in bulk:  # the same counts as the 16-byte REDs, exactly
                red_dkv = runs["adds_only"]()[1] if red_dkv is None else red_dkv
                row["dkv_equals_red_adds"] = bool(torch.equal(run(), red_dkv))
            print("RESULT", json.dumps(row), flush=True)
            rows.append(row)
        del q, kv, idx, cnt, dout, out, lse, delta, red_dkv
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
