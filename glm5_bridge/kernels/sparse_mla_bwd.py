"""Our sparse-MLA backward kernels (TileLang), written from the math, with a torch reference beside.

Math (see sparse_mla_fwd.py for the forward; lse is saved there, in log2 units, scale folded in):
    p[t,h,k]  = exp2(scale·log2e · q[t,h]·kv[idx[t,k]] − lse[t,h])       (0 for an empty slot)
    delta     = Σ_c out[t,h,c] · dout[t,h,c]
    ds        = p · (dout[t,h]·kv[idx[t,k], :512] − delta) · scale
    dq[t,h]   = Σ_k ds[t,h,k] · kv[idx[t,k]]
    dkv[j]   += Σ_{t,k: idx[t,k]=j} (Σ_h ds[t,h,k] · q[t,h])  +  (Σ_h p[t,h,k] · dout[t,h]) on :512

delta_kernel computes delta (fp32, one read of out and dout). Then fused_kernel, one CTA per
(token, block of min(H, 64) heads; H = 128 runs as two head blocks of one launch), 256 threads:
walks the token's top-k in blocks of 64 gathered keys: recomputes S = Q·Kᵀ, P from the saved lse,
dP = dO·Vᵀ, dS (both kept in shared memory); dq += dS·K in registers (wgmma at 64 heads); then the
block's dKV rows = dSᵀ·Q + Pᵀ·dO, 128 channels at a time (M = 64 wgmma tiles summed over heads),
added into dkv[idx] straight from the accumulator (16-byte fp32 atomics into a channel-permuted
dkv, DKV_ADD; `bwd` puts the channels back) while the next block's keys are already loading. No
P/dS tensor in global memory, no scratch, Q and dO read once. H100, 8K tokens × 64 heads: 15.23 ms
= 388 TFLOP/s with delta and the dkv zeroing (upstream's backward 70.76 ms). It replaced a
two-kernel split (ds_kernel wrote P and dS to global memory, dkv_kernel added the dKV rows),
which was slower at every head count (H200, 8K, one token per CTA: 20.1 / 18.2 / 15.7 ms at
64 / 32 / 16 heads against 15.4 / 15.3 / 12.2). The dKV adds (T × used slots × 576 fp32) are
the backward's floor: alone (dkv_adds_kernel) they take 10.7-10.9 ms at 8K whatever the head
count, about 3.2 TB/s of 16-byte fp32 reductions (H200).
So below 64 heads a CTA takes 64 // H neighbouring tokens (token_group): their (token, head) rows
fill the 64-row tiles and they walk the union of their slots (slot_union.py), a row masked where its
token did not select the key, so a shared key is gathered once and its dKV row summed over the
group before one add (H100, 8K × 16 heads: 8.0 ms against 13.5 with one token per CTA).
The kernel walks only a token's (a group's) active slot blocks (sparse_mla_fwd.active_slots).

Every kernel has a dynamic token count (one build for all lengths) and takes bfloat16 or float16
(the fused backend feeds fp32 models through float16: 8× finer rounding, see ops.py).
"""

import functools
import math

import torch

from glm5_bridge.kernels.slot_union import ROW_TILE, compile_union, grouped_shape, token_group, union_slots
from glm5_bridge.kernels._tilelang import D_QK, D_TAIL, D_V, LOG2E, compile_kernel, tl
from glm5_bridge.kernels.sparse_mla_fwd import heads_of, row_in_memory, row_io, scores_macro, walked_slots



def dq_dtype(dtype: str) -> str:
    """dq's element type: fp32 behind float16 kernels (they serve fp32 models, which keep fp32
    gradients), else the input type (a bf16 model; half the memory of an fp32 dq)."""
    return "float32" if dtype == "float16" else dtype


# The fused kernel's dKV adds, 16 bytes per thread, into dkv stored with its channels permuted
# within each 16-channel block (`fused_dkv_order` undoes it). A wgmma accumulator tile (m64nN,
# FullRow over two warpgroups: warpgroup w holds columns [w·N/2, (w+1)·N/2)) gives thread
# q = lane % 4, per 8 columns, the pair 2q, 2q+1 of row r = 16·warp + lane/4 (and of row r + 8).
# Stored at 4q + {0, 1} (first 8) and 4q + {2, 3} (second 8) of the 16-channel block, a thread's
# two pairs of a block are 4 consecutive floats: one red.global.add.v4.f32 instead of two .v2,
# and a warp's instruction covers 64 contiguous bytes of each of 8 rows instead of 32 bytes.
# acc: the thread's fragment (pairs in column order, row r then row r + 8); idx: the block's 64
# slot indices; dkv: column 0 of the tile in row 0. This reads TileLang 0.1.15's wgmma fragment
# layout by hand; if a TileLang release changes it, tests/gpu/test_sparse_mla_bwd.py's dkv fails.
DKV_ADD = r"""
template <int N>
__device__ __forceinline__ void glm5_dkv_add(const float* acc, const int* idx, float* dkv,
                                             int first_added, int num_kv) {
  const int tid = threadIdx.x, lane = tid & 31;
  const int r = ((tid & 127) >> 5) * 16 + (lane >> 2);
  const int row0 = idx[r], row1 = idx[r + 8];
  const bool add0 = row0 >= first_added && row0 < num_kv, add1 = row1 >= first_added && row1 < num_kv;
  float* base = dkv + (tid >> 7) * (N / 2) + 4 * (lane & 3);
  float* dst0 = base + (long long)(add0 ? row0 : 0) * 576;
  float* dst1 = base + (long long)(add1 ? row1 : 0) * 576;
  #pragma unroll
  for (int b = 0; b < N / 32; ++b) {
    const float* a = acc + 8 * b;
    if (add0) atomicAdd(reinterpret_cast<float4*>(dst0 + 16 * b), make_float4(a[0], a[1], a[4], a[5]));
    if (add1) atomicAdd(reinterpret_cast<float4*>(dst1 + 16 * b), make_float4(a[2], a[3], a[6], a[7]));
  }
}
"""


@functools.cache  # once per device, not per backward call
def fused_dkv_order(device=None) -> torch.Tensor:
    """[576] int64: column c of the true dkv is column order[c] of the fused kernel's dkv (channels
    permuted within 16-channel blocks, DKV_ADD): c = 16b + 8h + 2q + e sits at 16b + 4q + 2h + e."""
    c = torch.arange(D_QK, device=device)
    b, h, q, e = c // 16, (c // 8) % 2, (c // 2) % 4, c % 2
    return 16 * b + 4 * q + 2 * h + e


def fused_kernel(heads: int, topk: int, scale: float, dtype: str = "bfloat16", cols: int = 128,
                 adds: bool = True, min_blocks: int | None = None, group: int | None = None, head_blocks: int = 1):
    """The backward in one pass per (token, head block of min(heads, 64)); see the module
    docstring. Shared memory at 64 heads: Q, dO, one 64-key block, P and dS = 224 KB, so one CTA
    per SM and no staging buffer for the adds: they go straight from the accumulator fragments, 16
    bytes per thread into the channel-permuted dkv (DKV_ADD; the raw kernel's dkv needs
    `[:, fused_dkv_order()]`), so a warp's add covers 64 contiguous bytes of each of 8 rows. H200,
    4K / 8K / 16K tokens: 6.71 / 15.25 / 33.6 ms against 8.05 / 18.08 / 38.4 with 8-byte adds in
    natural channel order (32 bytes of 8 rows per instruction; same process). cols: dKV channels
    per wgmma tile — with the 8-byte adds 128 measured faster than 64 (18.4 ms) and as fast as 256
    (18.0 ms at 8K, which spills more registers). At 16 heads with one token per CTA (group=1) a
    CTA needs 110 KB, so two share an SM (min_blocks 2: ptxas then fits the kernel in 128
    registers without spills; 12.2 against 13.3 ms with one CTA per SM at 8K, H200).
    adds=False leaves the adds out (behind a run-time condition that never holds, so the GEMMs
    stay): the benchmark's cost split, not a backward. group: tokens per CTA (default
    token_group(heads)); above 1 the kernel sees each group as one "token" of group·heads rows and
    group·topk slots (the union, `fused_call`), a row seeing a slot where its token's bit is set
    in Vis. head_blocks > 1: q, dO, lse, delta and dq rows in the head-blocked layout
    (sparse_mla_fwd.row_in_memory)."""
    tilelang, T = tl()
    token_heads = heads
    group, rows_per_token, heads, topk = grouped_shape(heads, topk, group)
    # 64 keys per step and two warpgroups: DKV_ADD reads the m64 accumulator tile of two
    # warpgroups, 16-channel blocks per warpgroup
    block_i, threads = 64, 256
    hb = min(heads, ROW_TILE)
    if min_blocks is None:
        min_blocks = 2 if hb == 16 else 1
    assert heads % hb == 0 and hb >= 16 and topk % block_i == 0 and D_V % cols == 0 and cols % 32 == 0
    assert group == 1 or heads == hb, "token groups fill one head block"
    nhb, c = heads // hb, scale * LOG2E
    first_added = 0 if adds else 2**30  # no index reaches 2^30
    dt, f32 = getattr(T, dtype), T.float32
    dq_t = getattr(T, dq_dtype(dtype))
    n = T.dynamic("num_tokens")  # the rows of Idx: tokens, or token groups (their union)
    nkv = T.dynamic("num_kv")
    # q, dO, lse, delta and dq come as flat (token, head) rows: CTA bx takes rows [hb·bx, hb·bx +
    # hb) — a token's head block, or a token group. The last group of a token count that is not a
    # multiple of the group runs short: its missing rows load as zeros and are not stored
    # (TileLang bounds the copies by num_rows), so the caller pads nothing.
    nr = T.dynamic("num_rows")
    scores = scores_macro(T, hb, block_i, rows_per_token)
    rows = row_io(T, hb, nr, row_in_memory(token_heads, head_blocks, nr))

    @T.macro
    def store_dq(latent, tail, dQ, r0):
        # dq's 512 latent and 64 rope channels of rows r0 …; head-blocked builds through the row map
        if head_blocks == 1:
            T.copy(latent, dQ[r0:r0 + hb, 0:D_V])
            T.copy(tail, dQ[r0:r0 + hb, D_V:D_QK])
        else:
            rows.store(latent, dQ, r0, 0, D_V)
            rows.store(tail, dQ, r0, D_V, D_TAIL)

    @T.prim_func
    def main(Q: T.Tensor([nr, D_QK], dt), KV: T.Tensor([nkv, D_QK], dt),
             dO: T.Tensor([nr, D_V], dt), Idx: T.Tensor([n, topk], T.int32),
             Vis: T.Tensor([n, topk], T.int32), Cnt: T.Tensor([n], T.int32),
             Lse: T.Tensor([nr], f32), Delta: T.Tensor([nr], f32),
             dQ: T.Tensor([nr, D_QK], dq_t), dKV: T.Tensor([nkv, D_QK], f32)):
        with T.Kernel(n * nhb, threads=threads, prelude=DKV_ADD) as bx:
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            q_s = T.alloc_shared([hb, D_V], dt)
            qt_s = T.alloc_shared([hb, D_TAIL], dt)
            do_s = T.alloc_shared([hb, D_V], dt)
            k_s = T.alloc_shared([block_i, D_V], dt)
            kt_s = T.alloc_shared([block_i, D_TAIL], dt)
            ds_s = T.alloc_shared([hb, block_i], dt)
            p_s = T.alloc_shared([hb, block_i], dt)
            acc_s = T.alloc_fragment([hb, block_i], f32)
            acc_dp = T.alloc_fragment([hb, block_i], f32)
            acc_dq = T.alloc_fragment([hb, D_V], f32)
            acc_dqt = T.alloc_fragment([hb, D_TAIL], f32)
            acc_kv = T.alloc_fragment([block_i, cols], f32)
            acc_kvt = T.alloc_fragment([block_i, D_TAIL], f32)
            lse = T.alloc_fragment([hb], f32)
            delta = T.alloc_fragment([hb], f32)
            t, r0 = bx // nhb, bx * hb  # Idx row, first q row
            if head_blocks == 1:
                T.copy(Q[r0:r0 + hb, 0:D_V], q_s)
                T.copy(Q[r0:r0 + hb, D_V:D_QK], qt_s)
                T.copy(dO[r0:r0 + hb, :], do_s)
                T.copy(Lse[r0:r0 + hb], lse)
                T.copy(Delta[r0:r0 + hb], delta)
            else:  # a short last group's missing rows see no slot: their p, ds and dKV terms are 0
                rows.load(Q, r0, 0, q_s, D_V)
                rows.load(Q, r0, D_V, qt_s, D_TAIL)
                rows.load(dO, r0, 0, do_s, D_V)
                rows.load_row(Lse, r0, lse)
                rows.load_row(Delta, r0, delta)
            T.fill(acc_dq, 0)
            T.fill(acc_dqt, 0)
            # One stage: Q (72 KB) + dO (64 KB) leave room for one 72 KB block of 64 keys at 64
            # heads (measured faster than two stages of 32 keys: 16.0 vs 17.8 ms at 8K), and the
            # run-time trip count allows no deeper pipeline (sparse_mla_fwd.SKIP_NOTE).
            for i in T.Pipelined(T.ceildiv(Cnt[t], block_i), num_stages=1):
                scores(KV, Idx, Vis, t, i, q_s, qt_s, k_s, kt_s, acc_s)
                T.clear(acc_dp)
                T.gemm(do_s, k_s, acc_dp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for h, r in T.Parallel(hb, block_i):
                    acc_s[h, r] = T.exp2(acc_s[h, r] * c - lse[h])  # p; empty slot: exp2(−inf) = 0
                for h, r in T.Parallel(hb, block_i):
                    acc_dp[h, r] = acc_s[h, r] * (acc_dp[h, r] - delta[h]) * scale  # ds
                T.copy(acc_s, p_s)
                T.copy(acc_dp, ds_s)
                T.gemm(ds_s, k_s, acc_dq, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(ds_s, kt_s, acc_dqt, policy=T.GemmWarpPolicy.FullRow)
                # the keys are no longer needed: the pipeline starts the next block's gather here,
                # so the dKV GEMMs and adds below overlap its latency
                for cc in T.serial(D_V // cols):
                    T.gemm(ds_s, q_s[:, cc * cols:(cc + 1) * cols], acc_kv, transpose_A=True,
                           clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    T.gemm(p_s, do_s[:, cc * cols:(cc + 1) * cols], acc_kv, transpose_A=True,
                           policy=T.GemmWarpPolicy.FullRow)
                    T.call_extern("handle", f"glm5_dkv_add<{cols}>", acc_kv.data,
                                  T.address_of(Idx[t, i * block_i]), T.address_of(dKV[0, cc * cols]),
                                  first_added, nkv)
                T.gemm(ds_s, qt_s, acc_kvt, transpose_A=True, clear_accum=True,
                       policy=T.GemmWarpPolicy.FullRow)
                T.call_extern("handle", f"glm5_dkv_add<{D_TAIL}>", acc_kvt.data,
                              T.address_of(Idx[t, i * block_i]), T.address_of(dKV[0, D_V]),
                              first_added, nkv)
            if hb == 64 and dq_dtype(dtype) == dtype:
                # dq leaves through the Q tiles (free after the last block): 16-byte row stores
                # instead of 4-byte fragment stores; 15.2-15.3 against 15.5 ms at 8K x 64 heads, but
                # 16.9 against 15.3 at 32 heads (not profiled), so only at 64 (H200)
                T.copy(acc_dq, q_s)
                T.copy(acc_dqt, qt_s)
                store_dq(q_s, qt_s, dQ, r0)
            else:
                store_dq(acc_dq, acc_dqt, dQ, r0)

    return compile_kernel(main, out_idx=[])


def dkv_adds_kernel(topk: int, cols: int = 128):
    """The fused backward's dKV adds and nothing else: per token, per active 64-slot block, the same
    DKV_ADD calls (4 × 128 latent channels + 64 rope) of a constant 1 instead of the accumulator,
    no gathers, no GEMMs, 256 threads. dkv[j, c] += the number of times key j is selected. It
    measures the floor the adds put under the backward whatever its head count (the add bytes
    do not depend on H): benchmarks/bench_dsa.py's bwd_parts variant "adds_only"."""
    tilelang, T = tl()
    block_i, f32 = 64, T.float32
    n, nkv = T.dynamic("num_tokens"), T.dynamic("num_kv")

    @T.prim_func
    def main(Idx: T.Tensor([n, topk], T.int32), Cnt: T.Tensor([n], T.int32), dKV: T.Tensor([nkv, D_QK], f32)):
        with T.Kernel(n, threads=256, prelude=DKV_ADD) as t:
            ones = T.alloc_local([cols // 4], f32)  # one thread's share of an m64 x cols accumulator
            for j in T.serial(cols // 4):
                ones[j] = 1.0
            for i in T.serial(T.ceildiv(Cnt[t], block_i)):
                for cc in T.serial(D_V // cols):
                    T.call_extern("handle", f"glm5_dkv_add<{cols}>", ones.data, T.address_of(Idx[t, i * block_i]),
                                  T.address_of(dKV[0, cc * cols]), 0, nkv)
                T.call_extern("handle", f"glm5_dkv_add<{D_TAIL}>", ones.data, T.address_of(Idx[t, i * block_i]),
                              T.address_of(dKV[0, D_V]), 0, nkv)

    return compile_kernel(main, out_idx=[])


def delta_kernel(heads: int, dtype: str = "bfloat16", hb: int = 16, threads: int = 128):
    """delta[t, h] = Σ_c out[t, h, c] · dout[t, h, c] in fp32, one CTA per (token, 16 heads).
    In torch (out.float() * dout.float()).sum(-1) moves ~7 GB at 8K tokens × 64 heads (≈ 2 ms);
    this reads the two bf16 tensors once (1 GB)."""
    tilelang, T = tl()
    hb = min(hb, heads)
    assert heads % hb == 0
    dt, f32 = getattr(T, dtype), T.float32
    n = T.dynamic("num_tokens")

    @T.prim_func
    def main(O: T.Tensor([n, heads, D_V], dt), dO: T.Tensor([n, heads, D_V], dt),
             Delta: T.Tensor([n, heads], f32)):
        with T.Kernel(n, heads // hb, threads=threads) as (t, g):
            o = T.alloc_fragment([hb, D_V], dt)
            do = T.alloc_fragment([hb, D_V], dt)
            prod = T.alloc_fragment([hb, D_V], f32)
            d = T.alloc_fragment([hb], f32)
            T.copy(O[t, g * hb:(g + 1) * hb, :], o)
            T.copy(dO[t, g * hb:(g + 1) * hb, :], do)
            for h, c in T.Parallel(hb, D_V):
                prod[h, c] = T.cast(o[h, c], f32) * T.cast(do[h, c], f32)
            T.reduce_sum(prod, d, dim=1)
            T.copy(d, Delta[t, g * hb:(g + 1) * hb])

    return compile_kernel(main, out_idx=[-1])


@functools.cache
def get_delta_kernel(heads: int, dtype: str):
    return delta_kernel(heads, dtype)


@functools.cache
def get_fused_kernel(heads: int, topk: int, scale: float, dtype: str, head_blocks: int = 1):
    return fused_kernel(heads, topk, float(scale), dtype, head_blocks=head_blocks)


def compile_bwd(heads: int, topk: int, scale: float, dtype: str, head_blocks: int = 1) -> None:
    """Build what `bwd` runs for these shapes: the fused kernel and, for token groups, their union."""
    get_fused_kernel(heads, topk, scale, dtype, head_blocks)
    compile_union(heads, topk)


def _dtype_name(x: torch.Tensor) -> str:
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if x.dtype not in names:
        raise ValueError(f"our sparse-MLA kernels take bfloat16 or float16 q/kv; got {x.dtype}")
    return names[x.dtype]


def fused_call(kernel, group, q, kv, dout, idx, cnt, lse, delta, union=union_slots):
    """Run a fused_kernel build (made with this group) → (dq, dkv fp32 in true channel order).
    q [T,H,576], dout [T,H,512] contiguous, idx [T,K] int32, cnt as for
    sparse_mla_fwd.walked_slots, lse / delta [T,H] fp32 (for a build with head_blocks P, q, dout,
    lse, delta and dq head-blocked: [P,T,H/P,…]). For groups, union(idx, group) lists the
    ⌈T/group⌉ groups' slots (slot_union.py; the benchmark swaps in the torch sort)."""
    dq = torch.empty(q.shape, dtype=getattr(torch, dq_dtype(_dtype_name(q))), device=q.device)
    dkv = torch.zeros(kv.shape[0], D_QK, dtype=torch.float32, device=q.device)
    kernel(q.view(-1, D_QK), kv, dout.view(-1, D_V), *walked_slots(idx, cnt, group, union),
           lse.reshape(-1), delta.reshape(-1), dq.view(-1, D_QK), dkv)
    return dq, dkv[:, fused_dkv_order(dkv.device)]


def bwd(q, kv, out, dout, idx, lse, scale, used=None):
    """q [T,H,576], kv [Tkv,576], out/dout [T,H,512] (q's dtype), idx [T,K] int32, lse [T,H] (log2,
    from our forward or upstream's), used = active_slots(idx) if not given → dq [T,H,576]
    (dq_dtype), dkv [Tkv,576] fp32. H: a power of two ≥ 8; K a multiple of 64. q, out, dout, lse
    may come head-blocked ([P,T,H/P,…], sparse_mla_fwd.row_in_memory); dq then comes so too."""
    (h, blocks), k = heads_of(q), idx.shape[1]
    dtype = _dtype_name(q)
    q, kv, dout, idx = q.contiguous(), kv.contiguous(), dout.contiguous(), idx.contiguous()
    # delta is one number per row, whatever order the rows lie in: [rows, H] of memory order
    delta = get_delta_kernel(h, dtype)(out.contiguous().view(-1, h, D_V), dout.view(-1, h, D_V))
    return fused_call(get_fused_kernel(h, k, float(scale), dtype, blocks), token_group(h), q, kv, dout, idx,
                      used, lse.float().contiguous(), delta)


def bwd_reference(q, kv, out, dout, idx, lse, scale, chunk=256):
    """fp32 torch version of `bwd` (same arguments; lse in log2 units): (dq fp32, dkv fp32)."""
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(kv.shape[0], D_QK, dtype=torch.float32, device=q.device)
    kv32 = kv.float()
    for r0 in range(0, q.shape[0], chunk):
        i = idx[r0:r0 + chunk].long()
        valid = i >= 0
        keys = kv32[i.clamp(min=0)]
        q32, do = q[r0:r0 + chunk].float(), dout[r0:r0 + chunk].float()
        s = torch.einsum("thd,tkd->thk", q32, keys) * scale
        p = torch.exp(s - lse[r0:r0 + chunk, :, None].float() * math.log(2.0)).masked_fill(~valid[:, None, :], 0.0)
        delta = (out[r0:r0 + chunk].float() * do).sum(-1)
        ds = p * (torch.einsum("thc,tkc->thk", do, keys[..., :D_V]) - delta[..., None]) * scale
        dq[r0:r0 + chunk] = torch.einsum("thk,tkd->thd", ds, keys)
        dkeys = torch.einsum("thk,thd->tkd", ds, q32)
        dkeys[..., :D_V] += torch.einsum("thk,thc->tkc", p, do)
        dkv.index_add_(0, i.clamp(min=0).reshape(-1), (dkeys * valid[..., None]).reshape(-1, D_QK))
    return dq, dkv
