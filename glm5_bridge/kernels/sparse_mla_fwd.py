"""Our sparse-MLA forward kernels (TileLang), written from the math, with a torch reference beside.

Math (absorbed latent MLA, one kv head shared by all query heads):
    s[t,h,k]  = q[t,h,:576] · kv[idx[t,k], :576]            (idx −1 = empty slot, s = −inf)
    p         = softmax_k(scale · s)                          (fp32 statistics)
    out[t,h]  = Σ_k p[t,h,k] · kv[idx[t,k], :512]
    lse[t,h]  = log2 Σ_k exp(scale · s[t,h,k])                (log2 units; 0 for an all-empty row)

Layout: flat tokens, no batch axis. q [T, H, 576] bf16, kv [Tkv, 576] bf16, idx [T, K] int32 →
out [T, H, 512] bf16, lse [T, H] fp32. T and Tkv are *dynamic* in the compiled kernel (one build
serves every sequence length: no padding copies, no recompiles); H, K and the scale are baked in.

Variants (VARIANTS; measured on an H200 at S=8K, H=64, top-k 2048 — docs/kernels.md):
  "simple":   one CTA per (token, 64-head block), 256 threads; each 64-key block is gathered into
              shared memory (cp.async through T.Pipelined, 2 stages), S = Q·Kᵀ on both warpgroups,
              online softmax, O += P·V. The textbook flash-attention loop. 300 TFLOP/s (upstream
              294 in the same run). The one `ours_ops()` uses.
  "ws":       warp-specialised, 384 threads, 64 heads per CTA. WG2 gathers key blocks into two
              shared stages (plain loads + proxy fence + mbarrier); WG0 computes S = Q·Kᵀ over all
              576 channels, the online softmax and O[:, :256] += P·V[:, :256]; WG1 only does
              O[:, 256:] += P·V[:, 256:] with P and the rescale factor handed over in shared memory.
              Correct, but 277 TFLOP/s: WG0 carries 6.8 of the 8.9 MFLOP per step.
  "ws_async": "ws" with the producer issuing one cp.async row copy per key (32 of 128 threads
              active, 192 commit groups per step): 98 TFLOP/s, a latency-bound producer. Kept
              for the record only.
A 4-warpgroup split (WG0 softmax only, two PV warpgroups) does not compile: a 512-thread CTA caps
ptxas at 128 registers per thread, below the 64x256 fp32 accumulator of a PV warpgroup.
"""

import functools
import math

import torch

D_QK, D_V = 576, 512
D_TAIL = D_QK - D_V
LOG2E = 1.4426950408889634


def _tl():
    import tilelang
    import tilelang.language as T

    return tilelang, T


def _pass_configs(tilelang):
    return {tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
            tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


def scores_macro(T, hb: int, block_i: int):
    """One step of the key loop, shared by the forward and the backward (sparse_mla_bwd.ds_kernel):
    gather key block i (block_i rows of kv by index; −1 reads row 0 and is masked) into shared
    memory as latent / rope parts, and acc_s = Q·Kᵀ over all 576 channels, −inf on empty slots."""
    @T.macro
    def scores(KV, Idx, t, i, q_s, qt_s, k_s, kt_s, acc_s):
        for r, d in T.Parallel(block_i, D_V):
            k_s[r, d] = KV[T.max(Idx[t, i * block_i + r], 0), d]
        for r, d in T.Parallel(block_i, D_TAIL):
            kt_s[r, d] = KV[T.max(Idx[t, i * block_i + r], 0), D_V + d]
        for h, r in T.Parallel(hb, block_i):
            acc_s[h, r] = T.if_then_else(Idx[t, i * block_i + r] >= 0, 0, -T.infinity(T.float32))
        T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        T.gemm(qt_s, kt_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
    return scores


def simple_kernel(heads: int, topk: int, scale: float, block_i: int = 64, threads: int = 256, num_stages: int = 2,
                  dtype: str = "bfloat16"):
    tilelang, T = _tl()
    assert topk % block_i == 0
    hb = min(heads, 64)
    assert heads % hb == 0 and hb >= 16
    nhb, ni, c = heads // hb, topk // block_i, scale * LOG2E
    dt, f32 = getattr(T, dtype), T.float32
    n = T.dynamic("num_tokens")
    nkv = T.dynamic("num_kv")
    scores = scores_macro(T, hb, block_i)

    @T.prim_func
    def main(Q: T.Tensor([n, heads, D_QK], dt), KV: T.Tensor([nkv, D_QK], dt),
             Idx: T.Tensor([n, topk], T.int32), O: T.Tensor([n, heads, D_V], dt),
             Lse: T.Tensor([n, heads], f32)):
        with T.Kernel(n * nhb, threads=threads) as bx:
            q_s = T.alloc_shared([hb, D_V], dt)
            qt_s = T.alloc_shared([hb, D_TAIL], dt)
            k_s = T.alloc_shared([block_i, D_V], dt)
            kt_s = T.alloc_shared([block_i, D_TAIL], dt)
            p_s = T.alloc_shared([hb, block_i], dt)
            acc_s = T.alloc_fragment([hb, block_i], f32)
            acc_o = T.alloc_fragment([hb, D_V], f32)
            m = T.alloc_fragment([hb], f32)
            m_old = T.alloc_fragment([hb], f32)
            l = T.alloc_fragment([hb], f32)
            rs = T.alloc_fragment([hb], f32)
            alpha = T.alloc_fragment([hb], f32)
            t = bx // nhb
            h0 = (bx % nhb) * hb
            T.copy(Q[t, h0:h0 + hb, 0:D_V], q_s)
            T.copy(Q[t, h0:h0 + hb, D_V:D_QK], qt_s)
            T.fill(acc_o, 0)
            T.fill(l, 0)
            T.fill(m, -(2.0**30))
            for i in T.Pipelined(ni, num_stages=num_stages):
                scores(KV, Idx, t, i, q_s, qt_s, k_s, kt_s, acc_s)
                T.copy(m, m_old)
                T.reduce_max(acc_s, m, dim=1, clear=False)
                for h in T.Parallel(hb):
                    alpha[h] = T.exp2((m_old[h] - m[h]) * c)
                for h, r in T.Parallel(hb, block_i):
                    acc_s[h, r] = T.exp2(acc_s[h, r] * c - m[h] * c)
                T.reduce_sum(acc_s, rs, dim=1)
                for h in T.Parallel(hb):
                    l[h] = l[h] * alpha[h] + rs[h]
                for h, d in T.Parallel(hb, D_V):
                    acc_o[h, d] = acc_o[h, d] * alpha[h]
                T.copy(acc_s, p_s)
                T.gemm(p_s, k_s, acc_o, policy=T.GemmWarpPolicy.FullRow)
            for h, d in T.Parallel(hb, D_V):
                acc_o[h, d] = T.if_then_else(l[h] > 0, acc_o[h, d] / l[h], 0)
            for h in T.Parallel(hb):
                rs[h] = T.if_then_else(l[h] > 0, T.log2(l[h]) + m[h] * c, 0)
            T.copy(acc_o, O[t, h0:h0 + hb, :])
            T.copy(rs, Lse[t, h0:h0 + hb])

    return tilelang.compile(main, out_idx=[-2, -1], pass_configs=_pass_configs(tilelang))


def _gather_macro(T, bi, dh, producer):
    """Producer step: gather key block i (64 rows of kv by index, −1 → row 0, masked later) into one
    shared stage, split into latent-left / latent-right / rope parts. "sync": vectorised plain loads
    (registers stage the data); "async": one cp.async row copy per key (no registers, all in
    flight at once), then wait for this thread's copies."""
    if producer == "sync":
        @T.macro
        def gather(KV, Idx, t, i, kl, kr, kt):
            for r, d in T.Parallel(bi, dh):
                kl[r, d] = KV[T.max(Idx[t, i * bi + r], 0), d]
            for r, d in T.Parallel(bi, dh):
                kr[r, d] = KV[T.max(Idx[t, i * bi + r], 0), dh + d]
            for r, d in T.Parallel(bi, D_TAIL):
                kt[r, d] = KV[T.max(Idx[t, i * bi + r], 0), D_V + d]
    else:
        @T.macro
        def gather(KV, Idx, t, i, kl, kr, kt):
            for r in T.serial(bi):
                row = T.max(Idx[t, i * bi + r], 0)
                T.async_copy(KV[row, 0:dh], kl[r, 0:dh], coalesced_width=8)
                T.async_copy(KV[row, dh:D_V], kr[r, 0:dh], coalesced_width=8)
                T.async_copy(KV[row, D_V:D_QK], kt[r, 0:D_TAIL], coalesced_width=8)
            T.ptx_wait_group(0)
    return gather


def ws_kernel(heads: int, topk: int, scale: float, producer_regs: int = 56, consumer_regs: int = 224,
              producer: str = "sync"):
    """Warp-specialised forward (see the module docstring). heads must be a multiple of 64."""
    tilelang, T = _tl()
    bi, hb, dh = 64, 64, D_V // 2
    assert topk % bi == 0 and heads % hb == 0
    nhb, ni, c = heads // hb, topk // bi, scale * LOG2E
    bf16, f32 = T.bfloat16, T.float32
    n = T.dynamic("num_tokens")
    nkv = T.dynamic("num_kv")
    gather = _gather_macro(T, bi, dh, producer)

    @T.prim_func
    def main(Q: T.Tensor([n, heads, D_QK], bf16), KV: T.Tensor([nkv, D_QK], bf16),
             Idx: T.Tensor([n, topk], T.int32), O: T.Tensor([n, heads, D_V], bf16),
             Lse: T.Tensor([n, heads], f32)):
        with T.Kernel(n * nhb, threads=384) as bx:
            q_l = T.alloc_shared([hb, dh], bf16)
            q_r = T.alloc_shared([hb, dh], bf16)
            q_t = T.alloc_shared([hb, D_TAIL], bf16)
            kl0 = T.alloc_shared([bi, dh], bf16)
            kr0 = T.alloc_shared([bi, dh], bf16)
            kt0 = T.alloc_shared([bi, D_TAIL], bf16)
            kl1 = T.alloc_shared([bi, dh], bf16)
            kr1 = T.alloc_shared([bi, dh], bf16)
            kt1 = T.alloc_shared([bi, D_TAIL], bf16)
            p_s = T.alloc_shared([hb, bi], bf16)
            alpha_s = T.alloc_shared([hb], f32)
            inv_s = T.alloc_shared([hb], f32)
            acc_s = T.alloc_fragment([hb, bi], f32)
            acc_o = T.alloc_fragment([hb, dh], f32)
            acc_o2 = T.alloc_fragment([hb, dh], f32)
            m = T.alloc_fragment([hb], f32)
            m_old = T.alloc_fragment([hb], f32)
            l = T.alloc_fragment([hb], f32)
            rs = T.alloc_fragment([hb], f32)
            alpha = T.alloc_fragment([hb], f32)
            # 0/1: stage full (producer, 128)  2/3: stage empty (WG0 + WG1, 256)
            # 4: P ready (WG0, 128)  5: P consumed (WG1, 128)  6: final 1/l ready (WG0, 128)
            bars = T.alloc_barrier([128, 128, 256, 256, 128, 128, 128])
            tx = T.get_thread_binding()
            t = bx // nhb
            h0 = (bx % nhb) * hb

            if tx < 128:
                T.set_max_nreg(consumer_regs, 1)
                T.copy(Q[t, h0:h0 + hb, 0:dh], q_l)
                T.copy(Q[t, h0:h0 + hb, dh:D_V], q_r)
                T.copy(Q[t, h0:h0 + hb, D_V:D_QK], q_t)
                T.fill(acc_o, 0)
                T.fill(l, 0)
                T.fill(m, -(2.0**30))
                for i in T.serial(ni):
                    T.barrier_wait(bars[i % 2], (i // 2) % 2)
                    for h, r in T.Parallel(hb, bi):
                        acc_s[h, r] = T.if_then_else(Idx[t, i * bi + r] >= 0, 0, -T.infinity(f32))
                    if i % 2 == 0:
                        T.gemm(q_l, kl0, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                        T.gemm(q_r, kr0, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                        T.gemm(q_t, kt0, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    else:
                        T.gemm(q_l, kl1, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                        T.gemm(q_r, kr1, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                        T.gemm(q_t, kt1, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    T.copy(m, m_old)
                    T.reduce_max(acc_s, m, dim=1, clear=False)
                    for h in T.Parallel(hb):
                        alpha[h] = T.exp2((m_old[h] - m[h]) * c)
                    for h, r in T.Parallel(hb, bi):
                        acc_s[h, r] = T.exp2(acc_s[h, r] * c - m[h] * c)
                    T.reduce_sum(acc_s, rs, dim=1)
                    for h in T.Parallel(hb):
                        l[h] = l[h] * alpha[h] + rs[h]
                    if i > 0:
                        T.barrier_wait(bars[5], (i - 1) % 2)
                    T.copy(acc_s, p_s)
                    for h in T.Parallel(hb):
                        alpha_s[h] = alpha[h]
                    T.fence_proxy_async()
                    T.barrier_arrive(bars[4])
                    for h, d in T.Parallel(hb, dh):
                        acc_o[h, d] = acc_o[h, d] * alpha[h]
                    if i % 2 == 0:
                        T.gemm(p_s, kl0, acc_o, policy=T.GemmWarpPolicy.FullRow)
                    else:
                        T.gemm(p_s, kl1, acc_o, policy=T.GemmWarpPolicy.FullRow)
                    T.barrier_arrive(bars[2 + i % 2])
                for h in T.Parallel(hb):
                    alpha[h] = T.if_then_else(l[h] > 0, 1.0 / l[h], 0)
                    rs[h] = T.if_then_else(l[h] > 0, T.log2(l[h]) + m[h] * c, 0)
                T.copy(alpha, inv_s)
                T.barrier_arrive(bars[6])
                for h, d in T.Parallel(hb, dh):
                    acc_o[h, d] = acc_o[h, d] * alpha[h]
                T.copy(acc_o, O[t, h0:h0 + hb, 0:dh])
                T.copy(rs, Lse[t, h0:h0 + hb])
            elif tx < 256:
                T.set_max_nreg(consumer_regs, 1)
                T.fill(acc_o2, 0)
                for i in T.serial(ni):
                    T.barrier_wait(bars[4], i % 2)
                    T.barrier_wait(bars[i % 2], (i // 2) % 2)
                    for h, d in T.Parallel(hb, dh):
                        acc_o2[h, d] = acc_o2[h, d] * alpha_s[h]
                    if i % 2 == 0:
                        T.gemm(p_s, kr0, acc_o2, policy=T.GemmWarpPolicy.FullRow)
                    else:
                        T.gemm(p_s, kr1, acc_o2, policy=T.GemmWarpPolicy.FullRow)
                    T.barrier_arrive(bars[5])
                    T.barrier_arrive(bars[2 + i % 2])
                T.barrier_wait(bars[6], 0)
                for h, d in T.Parallel(hb, dh):
                    acc_o2[h, d] = acc_o2[h, d] * inv_s[h]
                T.copy(acc_o2, O[t, h0:h0 + hb, dh:D_V])
            else:
                T.set_max_nreg(producer_regs, 0)
                for i in T.serial(ni):
                    if i >= 2:
                        T.barrier_wait(bars[2 + i % 2], ((i // 2) + 1) % 2)
                    if i % 2 == 0:
                        gather(KV, Idx, t, i, kl0, kr0, kt0)
                    else:
                        gather(KV, Idx, t, i, kl1, kr1, kt1)
                    T.fence_proxy_async()
                    T.barrier_arrive(bars[i % 2])

    return tilelang.compile(main, out_idx=[-2, -1], pass_configs=_pass_configs(tilelang))


VARIANTS = {
    "simple": simple_kernel,
    "ws": ws_kernel,
    "ws_async": functools.partial(ws_kernel, producer="async"),
}


@functools.cache
def get_kernel(variant: str, heads: int, topk: int, scale: float, dtype: str = "bfloat16"):
    """The "ws" variants are bfloat16 only (`fwd` runs "simple" for float16)."""
    return VARIANTS[variant](heads, topk, float(scale), **({} if dtype == "bfloat16" else {"dtype": dtype}))


def fwd(q, kv, idx, scale, variant="simple"):
    """q [T,H,576], kv [T,576] (both bfloat16 or both float16), idx [T,K] int32 (K a multiple of 64,
    H a power of two ≥ 16; "ws" needs H a multiple of 64 and bfloat16, and falls back to "simple"
    otherwise) → out [T,H,512] (q's dtype), lse [T,H] fp32."""
    t, h, _ = q.shape
    dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[q.dtype]
    if variant.startswith("ws") and (h % 64 or dtype != "bfloat16"):
        variant = "simple"
    kernel = get_kernel(variant, h, idx.shape[1], float(scale), dtype)
    return kernel(q.contiguous(), kv.contiguous(), idx.contiguous())


def fwd_reference(q, kv, idx, scale, chunk=256):
    """fp32 torch version of the same function, chunked over tokens: (out fp32, lse2 fp32)."""
    outs, lses = [], []
    for r0 in range(0, q.shape[0], chunk):
        i = idx[r0:r0 + chunk].long()
        valid = i >= 0
        keys = kv.float()[i.clamp(min=0)]
        s = torch.einsum("thd,tkd->thk", q[r0:r0 + chunk].float(), keys) * scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        any_valid = valid.any(-1)[:, None]
        p = torch.exp(s - torch.where(any_valid, lse, torch.zeros_like(lse))[..., None])
        p = torch.nan_to_num(p, nan=0.0)
        outs.append(torch.einsum("thk,tkc->thc", p, keys[..., :D_V]))
        lses.append(torch.where(any_valid, lse / math.log(2.0), torch.zeros_like(lse)))
    return torch.cat(outs), torch.cat(lses)
