"""Our sparse-MLA forward kernels (TileLang), written from the math, with a torch reference beside.

Math (absorbed latent MLA, one kv head shared by all query heads):
    s[t,h,k]  = q[t,h,:576] · kv[idx[t,k], :576]            (idx −1 = empty slot, s = −inf)
    p         = softmax_k(scale · s)                          (fp32 statistics)
    out[t,h]  = Σ_k p[t,h,k] · kv[idx[t,k], :512]
    lse[t,h]  = log2 Σ_k exp(scale · s[t,h,k])                (log2 units; 0 for an all-empty row)

Layout: flat tokens, no batch axis. q [T, H, 576] bf16, kv [Tkv, 576] bf16, idx [T, K] int32 →
out [T, H, 512] bf16, lse [T, H] fp32. T and Tkv are *dynamic* in the compiled kernel (one build
serves every sequence length: no padding copies, no recompiles); H, K and the scale are baked in.

Kernel ("simple"; measured on an H200 at S=8K, H=64, top-k 2048 — docs/kernels.md): one CTA per
(token, 64-head block), 256 threads; each block of keys (128 at 64 heads, `block_keys`) is
gathered into shared memory (cp.async through T.Pipelined), S = Q·Kᵀ on both warpgroups (each an
m64n64 wgmma over its half of the keys), online softmax, O += P·V in 64-key halves — the textbook
flash-attention loop. It walks only a token's *active* slots, ceil(cnt[t] / block) blocks where
cnt[t] = 1 + the last non-empty slot (`active_slots`): rows whose −1 slots come last (select_topk's
order, which `SparseMLA` enforces) skip their empty blocks, e.g. the first 2048 tokens of a causal
sequence. Run P: 5.18 ms = 451 TFLOP/s nominal over all slots (64-key blocks: 6.09 ms = 384, run
O; upstream 7.95 ms in the same run); on slots with −1 interleaved (nothing to skip) 6.55 ms.
Two warp-specialised variants (a producer warpgroup feeding two math warpgroups through mbarriers;
277 and 98 TFLOP/s) were slower and are gone (git history before 2026-12-03; docs/kernels.md).
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

    from glm5_bridge.kernels import tilelang_compat

    tilelang_compat.install()  # before any kernel is built
    return tilelang, T


def _pass_configs(tilelang):
    return {tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
            tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


# SKIP_NOTE: a loop over a token's active blocks has a run-time trip count. TileLang 0.1.15 then
# cannot build a cp.async pipeline deeper than num_stages=1 (its epilogue's wait count becomes an
# expression: "Downcast from tirx.Sub to ir.IntImm failed" in codegen), so skipping kernels run
# one stage (the next block's gather still overlaps this block's math).


PV_KEYS = 64  # keys per P·V GEMM (and per P tile in shared memory)


def block_keys(heads: int, topk: int, skip_empty: bool = True) -> int:
    """Keys per step of the forward. 128 at 64 heads: each warpgroup's share of S = Q·Kᵀ is an
    m64n64 wgmma instead of m64n32 (a third less shared-memory traffic per key) and the softmax
    exchanges row statistics once per 128 keys. Shared memory: Q 72 KB + 128 keys 144 KB + one
    64-key P tile 8 KB = 224 KB, so P·V runs in two 64-key halves. H200, 8K tokens: 5.18 against
    6.09 ms with 64 keys (runs P, O). 64 without skipping (two pipeline stages would not fit),
    below 64 heads (at 16 heads TileLang 0.1.15 cannot lower the 128-wide row reductions) and when
    top-k is not a multiple of 128."""
    return 128 if skip_empty and min(heads, 64) == 64 and topk % 128 == 0 else 64


def scores_macro(T, hb: int, block_i: int):
    """One step of the key loop, shared by the forward and the backward (sparse_mla_bwd):
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


def simple_kernel(heads: int, topk: int, scale: float, block_i: int | None = None, threads: int = 256,
                  num_stages: int | None = None, dtype: str = "bfloat16", skip_empty: bool = True):
    """block_i: keys per step, default block_keys(heads, topk, skip_empty). skip_empty=False walks
    all top-k blocks whatever Cnt says (the benchmark's baseline, 64-key blocks in two stages)."""
    tilelang, T = _tl()
    hb = min(heads, 64)
    block_i = block_i or block_keys(heads, topk, skip_empty)
    half = min(block_i, PV_KEYS)  # P goes through shared memory PV_KEYS keys at a time
    halves = tuple(range(block_i // half))  # a Python tuple: unrolled at trace time
    assert topk % block_i == 0 and block_i % half == 0
    assert heads % hb == 0 and hb >= 16
    nhb, c = heads // hb, scale * LOG2E
    num_stages = num_stages or (1 if skip_empty else 2)  # see SKIP_NOTE
    dt, f32 = getattr(T, dtype), T.float32
    n = T.dynamic("num_tokens")
    nkv = T.dynamic("num_kv")
    scores = scores_macro(T, hb, block_i)

    @T.prim_func
    def main(Q: T.Tensor([n, heads, D_QK], dt), KV: T.Tensor([nkv, D_QK], dt),
             Idx: T.Tensor([n, topk], T.int32), Cnt: T.Tensor([n], T.int32),
             O: T.Tensor([n, heads, D_V], dt), Lse: T.Tensor([n, heads], f32)):
        with T.Kernel(n * nhb, threads=threads) as bx:
            q_s = T.alloc_shared([hb, D_V], dt)
            qt_s = T.alloc_shared([hb, D_TAIL], dt)
            k_s = T.alloc_shared([block_i, D_V], dt)
            kt_s = T.alloc_shared([block_i, D_TAIL], dt)
            p_s = T.alloc_shared([hb, half], dt)
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
            # At least one step, written inline (a named trip count becomes a let the simplifier
            # cannot see through): then the peeled last step is not wrapped statement by
            # statement in "if any step". An all-empty row's one step adds nothing (its P is 0).
            for i in T.Pipelined(T.max(T.ceildiv(Cnt[t], block_i), 1) if skip_empty else topk // block_i,
                                 num_stages=num_stages):
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
                if len(halves) == 1:
                    T.copy(acc_s, p_s)
                    T.gemm(p_s, k_s, acc_o, policy=T.GemmWarpPolicy.FullRow)
                else:
                    for j in halves:
                        # The loop spans the whole accumulator and keeps part j: a loop over only
                        # acc_s[:, j·half:(j+1)·half] gets a wrong thread binding in TileLang 0.1.15
                        # (the second warpgroup's rows were written past the end of p_s).
                        for h, r in T.Parallel(hb, block_i):
                            if r // half == j:
                                p_s[h, r % half] = acc_s[h, r]
                        # rows j·half… of k_s: tilelang_compat item 1 corrects this slice's B offsets
                        T.gemm(p_s, k_s[j * half:(j + 1) * half, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
            for h, d in T.Parallel(hb, D_V):
                acc_o[h, d] = T.if_then_else(l[h] > 0, acc_o[h, d] / l[h], 0)
            for h in T.Parallel(hb):
                rs[h] = T.if_then_else(l[h] > 0, T.log2(l[h]) + m[h] * c, 0)
            T.copy(acc_o, O[t, h0:h0 + hb, :])
            T.copy(rs, Lse[t, h0:h0 + hb])

    return tilelang.compile(main, out_idx=[-2, -1], pass_configs=_pass_configs(tilelang))


def active_slots(idx: torch.Tensor) -> torch.Tensor:
    """[T, K] int32 slot indices → [T] int32: 1 + the position of the last non-empty slot (0 for an
    all-empty row). The kernels walk slot blocks only up to there; −1 slots before it stay masked."""
    positions = torch.arange(1, idx.shape[1] + 1, dtype=torch.int32, device=idx.device)
    return torch.where(idx >= 0, positions, 0).amax(dim=1).to(torch.int32)


@functools.cache
def get_kernel(heads: int, topk: int, scale: float, dtype: str = "bfloat16"):
    return simple_kernel(heads, topk, float(scale), dtype=dtype)


def fwd(q, kv, idx, scale, cnt=None):
    """q [T,H,576], kv [T,576] (both bfloat16 or both float16), idx [T,K] int32 (K a multiple of 64,
    H a power of two ≥ 16), cnt = active_slots(idx) if not given → out [T,H,512] (q's dtype),
    lse [T,H] fp32."""
    t, h, _ = q.shape
    dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[q.dtype]
    kernel = get_kernel(h, idx.shape[1], float(scale), dtype)
    cnt = active_slots(idx) if cnt is None else cnt
    return kernel(q.contiguous(), kv.contiguous(), idx.contiguous(), cnt)


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
