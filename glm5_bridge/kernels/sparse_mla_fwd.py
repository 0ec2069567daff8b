"""Our sparse-MLA forward kernels (TileLang), written from the math, with a torch reference beside.

Math (absorbed latent MLA, one kv head shared by all query heads):
    s[t,h,k]  = q[t,h,:576] · kv[idx[t,k], :576]            (idx −1 = empty slot, s = −inf)
    p         = softmax_k(scale · s)                          (fp32 statistics)
    out[t,h]  = Σ_k p[t,h,k] · kv[idx[t,k], :512]
    lse[t,h]  = log2 Σ_k exp(scale · s[t,h,k])                (log2 units; 0 for an all-empty row)

Layout: flat tokens, no batch axis. q [T, H, 576] bf16, kv [Tkv, 576] bf16, idx [T, K] int32 →
out [T, H, 512] bf16, lse [T, H] fp32. T and Tkv are *dynamic* in the compiled kernel (one build
serves every sequence length: no padding copies, no recompiles); H, K and the scale are baked in.

Two kernels (times at S=8K, top-k 2048, GPU named; history in benchmarks/LOG.md), both walking
only a token's *active* slots, ceil(cnt[t] / block) blocks where cnt[t] = 1 + the last non-empty slot
(`active_slots`): rows whose −1 slots come last (select_topk's order, which `SparseMLA` enforces)
skip their empty blocks, e.g. the first 2048 tokens of a causal sequence.
Both run 64-row tiles: a token's block of 64 heads, or below 64 heads a token group
(slot_union.token_group: 64 / H neighbouring tokens whose rows fill the tile, walking the union of
their slots, each row masked where its token did not select the key, as in the backward). q, O and
lse go as flat (token, head) rows (`fwd_call`), the last group's missing rows bounded by the row count.
- `seesaw_kernel` (what `get_kernel` builds for GLM-5 at every TP: 64-row tiles, slots per CTA a
  multiple of 128): warp-specialised — a producer warpgroup gathers 64-key blocks into two
  stages, two math warpgroups own alternate blocks so one's softmax overlaps the other's GEMMs
  (FlashMLA's sparse-prefill schedule). 3.83 ms = 609 TFLOP/s nominal over all slots at 64 heads,
  on an H100 and on an H200 (upstream's forward 7.92 ms on the H100). Over token groups (H100, one
  process): 2.01 / 2.94 ms at 16 / 32 heads, against 2.65 / 3.86 for simple_kernel's groups and
  3.92 / 6.02 per token.
- `simple_kernel` (top-k not a multiple of 128, and the benchmark's baselines): 256 threads; each
  block of keys (128 at 64 rows, `block_keys`) is gathered into shared memory (cp.async through
  T.Pipelined), S = Q·Kᵀ on both warpgroups, online softmax, O += P·V in 64-key halves — the
  textbook flash-attention loop. H200: 5.18 ms = 451 TFLOP/s at 64 heads (upstream 7.95 ms in
  the same process); on slots with −1 interleaved (nothing to skip) 6.55 ms.
"""

import functools
import math
from types import SimpleNamespace

import torch

from glm5_bridge.kernels._tilelang import D_QK, D_TAIL, D_V, LOG2E, compile_kernel, tl
from glm5_bridge.kernels.slot_union import ROW_TILE, compile_union, grouped_shape, token_group, union_slots



# SKIP_NOTE: a loop over a token's active blocks has a run-time trip count. TileLang 0.1.15 then
# cannot build a cp.async pipeline deeper than num_stages=1 (its epilogue's wait count becomes an
# expression: "Downcast from tirx.Sub to ir.IntImm failed" in codegen), so skipping kernels run
# one stage (the next block's gather still overlaps this block's math).


PV_KEYS = 64  # keys per P·V GEMM (and per P tile in shared memory)


def row_in_memory(heads: int, head_blocks: int, num_rows):
    """Where the kernels find row r = token·heads + head (their flat (token, head) order) of q, out,
    lse (and, backward, dO, dq, delta): a function r → its row in memory. head_blocks 1: q [T, H, 576],
    row r itself. head_blocks P: q head-blocked [P, T, H/P, 576] — as token-parallel attention's
    all-to-all delivers it (model/attention/token_parallel.py), block p holding heads p·H/P … of every
    token — so the kernels read and write that layout in place instead of the caller transposing it
    both ways. Works on ints, torch tensors and TIR expressions (num_rows: T·H, dynamic in a kernel)."""
    if head_blocks == 1:
        return lambda r: r
    per_block = heads // head_blocks
    assert per_block * head_blocks == heads, f"{heads} heads do not split into {head_blocks} blocks"
    tokens = num_rows // heads
    return lambda r: (r % heads) // per_block * (tokens * per_block) + r // heads * per_block + r % per_block


def block_keys(heads: int, topk: int, skip_empty: bool = True) -> int:
    """Keys per step of `simple_kernel` (at 64 heads and top-k % 128 == 0 `get_kernel` builds
    `seesaw_kernel` instead; the 128-key case serves direct calls). 128 at 64 heads: each
    warpgroup's share of S = Q·Kᵀ is an m64n64 wgmma instead of m64n32 (a third less
    shared-memory traffic per key) and the softmax exchanges row statistics once per 128 keys.
    Shared memory: Q 72 KB + 128 keys 144 KB + one 64-key P tile 8 KB = 224 KB, so P·V runs in
    two 64-key halves. H200, 8K tokens: 5.18 against
    6.09 ms with 64 keys. 64 without skipping (two pipeline stages would not fit),
    below 64 rows per CTA (one token per CTA below 64 heads: at 16 rows TileLang 0.1.15 cannot
    lower the 128-wide row reductions; token groups fill 64 rows) and when top-k is not a multiple
    of 128. heads: rows per CTA (a token group's g·H), topk: slots per CTA (its union's g·K)."""
    return 128 if skip_empty and min(heads, 64) == 64 and topk % 128 == 0 else 64


def visible(Vis, t, slot, h, rows_per_token: int):
    """Whether row h of CTA row t may see `slot` (a TIR condition, for the kernels' score masks):
    one token per CTA (rows_per_token 0), the slot holds a key (Vis is Idx itself, −1 empty);
    token groups, the row's token (h // rows_per_token) set its bit in Vis."""
    if rows_per_token:
        return (Vis[t, slot] >> (h // rows_per_token)) & 1 == 1
    return Vis[t, slot] >= 0


def row_io(T, hb: int, nr, at):
    """Macros moving a CTA's hb rows r0 … r0 + hb − 1 between global memory, at rows at(r) (a
    `row_in_memory` map), and its tiles: load / load_row read columns col0 … of 2-D / one value of
    1-D rows, a short last group's rows past nr reading the last row (they see no slot: masked,
    never stored); store writes only rows below nr (the kernels add no bounds of their own there)."""
    @T.macro
    def load(Src, r0, col0, dst, cols):
        for r, d in T.Parallel(hb, cols):
            dst[r, d] = Src[at(T.min(r0 + r, nr - 1)), col0 + d]

    @T.macro
    def load_row(Src, r0, dst):
        for r in T.Parallel(hb):
            dst[r] = Src[at(T.min(r0 + r, nr - 1))]

    @T.macro
    def store(src, Dst, r0, col0, cols):
        for r, d in T.Parallel(hb, cols):
            if r0 + r < nr:
                Dst[at(r0 + r), col0 + d] = src[r, d]

    @T.macro
    def store_row(src, Dst, r0):
        for r in T.Parallel(hb):
            if r0 + r < nr:
                Dst[at(r0 + r)] = src[r]

    return SimpleNamespace(load=load, load_row=load_row, store=store, store_row=store_row)


def scores_macro(T, hb: int, block_i: int, rows_per_token: int = 0):
    """One step of the key loop, shared by the forward and the backward (sparse_mla_bwd):
    gather key block i (block_i rows of kv by index; −1 reads row 0 and is masked) into shared
    memory as latent / rope parts, and acc_s = Q·Kᵀ over all 576 channels, −inf where row h may
    not see the slot (`visible`)."""
    @T.macro
    def scores(KV, Idx, Vis, t, i, q_s, qt_s, k_s, kt_s, acc_s):
        for r, d in T.Parallel(block_i, D_V):
            k_s[r, d] = KV[T.max(Idx[t, i * block_i + r], 0), d]
        for r, d in T.Parallel(block_i, D_TAIL):
            kt_s[r, d] = KV[T.max(Idx[t, i * block_i + r], 0), D_V + d]
        for h, r in T.Parallel(hb, block_i):
            acc_s[h, r] = T.if_then_else(visible(Vis, t, i * block_i + r, h, rows_per_token), 0, -T.infinity(T.float32))
        T.gemm(q_s, k_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        T.gemm(qt_s, kt_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
    return scores


def simple_kernel(heads: int, topk: int, scale: float, block_i: int | None = None, threads: int = 256,
                  num_stages: int | None = None, dtype: str = "bfloat16", skip_empty: bool = True,
                  group: int | None = None, head_blocks: int = 1):
    """block_i: keys per step, default block_keys(rows per CTA, slots, skip_empty). skip_empty=False
    walks all top-k blocks whatever Cnt says (the benchmark's baseline, 64-key blocks in two
    stages). group: tokens per CTA (default token_group(heads): 4 at 16 heads, 2 at 32); above 1
    a CTA runs the group's group·heads rows over the union of their slots (slot_union.py), a row
    seeing a slot where its token's bit is set in Vis, as the backward's token groups do. Call it
    through `fwd_call`: q, O and lse go as flat (token, head) rows, CTA bx taking rows
    [hb·bx, hb·bx + hb), the last group's missing rows bounded by num_rows; head_blocks > 1 reads and
    writes those rows in the head-blocked layout (`row_in_memory`)."""
    tilelang, T = tl()
    token_heads = heads
    group, rows_per_token, heads, topk = grouped_shape(heads, topk, group)
    hb = min(heads, ROW_TILE)
    assert group == 1 or heads == hb, "token groups fill one row tile"
    block_i = block_i or block_keys(heads, topk, skip_empty)
    half = min(block_i, PV_KEYS)  # P goes through shared memory PV_KEYS keys at a time
    halves = tuple(range(block_i // half))  # a Python tuple: unrolled at trace time
    assert topk % block_i == 0 and block_i % half == 0
    assert heads % hb == 0 and hb >= 16
    nhb, c = heads // hb, scale * LOG2E
    num_stages = num_stages or (1 if skip_empty else 2)  # see SKIP_NOTE
    dt, f32 = getattr(T, dtype), T.float32
    n = T.dynamic("num_tokens")  # the rows of Idx: tokens, or token groups (their union)
    nkv = T.dynamic("num_kv")
    nr = T.dynamic("num_rows")
    scores = scores_macro(T, hb, block_i, rows_per_token)
    rows = row_io(T, hb, nr, row_in_memory(token_heads, head_blocks, nr))

    @T.prim_func
    def main(Q: T.Tensor([nr, D_QK], dt), KV: T.Tensor([nkv, D_QK], dt),
             Idx: T.Tensor([n, topk], T.int32), Vis: T.Tensor([n, topk], T.int32), Cnt: T.Tensor([n], T.int32),
             O: T.Tensor([nr, D_V], dt), Lse: T.Tensor([nr], f32)):
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
            t, r0 = bx // nhb, bx * hb  # Idx row, first q row
            if head_blocks == 1:
                T.copy(Q[r0:r0 + hb, 0:D_V], q_s)
                T.copy(Q[r0:r0 + hb, D_V:D_QK], qt_s)
            else:
                rows.load(Q, r0, 0, q_s, D_V)
                rows.load(Q, r0, D_V, qt_s, D_TAIL)
            T.fill(acc_o, 0)
            T.fill(l, 0)
            T.fill(m, -(2.0**30))
            # At least one step, written inline (a named trip count becomes a let the simplifier
            # cannot see through): then the peeled last step is not wrapped statement by
            # statement in "if any step". An all-empty row's one step adds nothing (its P is 0).
            for i in T.Pipelined(T.max(T.ceildiv(Cnt[t], block_i), 1) if skip_empty else topk // block_i,
                                 num_stages=num_stages):
                scores(KV, Idx, Vis, t, i, q_s, qt_s, k_s, kt_s, acc_s)
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
            for h in T.Parallel(hb):
                alpha[h] = T.if_then_else(l[h] > 0, 1.0 / l[h], 0)  # see seesaw_kernel's normalise
            for h, d in T.Parallel(hb, D_V):
                acc_o[h, d] = acc_o[h, d] * alpha[h]
            for h in T.Parallel(hb):
                rs[h] = T.if_then_else(l[h] > 0, T.log2(l[h]) + m[h] * c, 0)
            if head_blocks == 1:
                T.copy(acc_o, O[r0:r0 + hb, :])
                T.copy(rs, Lse[r0:r0 + hb])
            else:
                rows.store(acc_o, O, r0, 0, D_V)
                rows.store_row(rs, Lse, r0)

    return compile_kernel(main, out_idx=[-2, -1])


def fwd_call(kernel, group, q, kv, idx, cnt=None, union=union_slots):
    """Run a simple_kernel or seesaw_kernel build (made with this group): q [T,H,576] (or, for a
    build with head_blocks P, head-blocked [P,T,H/P,576]), kv [T,576], idx [T,K] int32, cnt as for
    `walked_slots` → out [T,H,512], lse [T,H] (head-blocked: [P,T,H/P,512], [P,T,H/P])."""
    out, lse = kernel(q.reshape(-1, D_QK), kv, *walked_slots(idx, cnt, group, union))
    return out.view(*q.shape[:-1], D_V), lse.view(q.shape[:-1])


def seesaw_kernel(heads: int, topk: int, scale: float, dtype: str = "bfloat16", regs=(216, 216, 72),
                  group: int | None = None, head_blocks: int = 1):
    """The forward over 64-row tiles (`uses_seesaw`): a token's 64-head block, or below 64 heads a
    token group (group as in simple_kernel; call it through `fwd_call`). Warp-specialised, 384 threads. Keys come in 64-key blocks through two stages, each stored as
    three parts — latent left half kl (channels 0…255), right half kr (256…511), rope kt (512…575).
    WG0 owns the even blocks (stage 0), WG1 the odd ones (stage 1): each computes S = Q·Kᵀ and the
    softmax of its own block, so one warpgroup's softmax runs while the other's GEMMs do. O is split
    by columns: WG0 accumulates O[:, :256] (P·V over kl of every block), WG1 O[:, 256:] (kr).
    Per pair of blocks (2p, 2p+1):
      WG0: QK(2p) → softmax at m(2p) = max(m(2p−1), row max) → own P·V from registers (wgmma RS)
           → once WG1 has m(2p+1): P(2p) rescaled to it, stored in kt0 (the rope part, free after
           QK) for WG1 → O rescaled → P·V with WG1's P(2p+1) (kt1) over kl1.
      WG1: QK(2p+1) → softmax at m(2p+1) → own P·V from registers, P(2p+1) stored in kt1 beside
           it → P·V with WG0's rescaled P(2p) over kr0.
    The running max is handed block to block through shared memory (`ready` mbarriers); the row
    sums l are kept per warpgroup at its O's scale and added at the end. Each part of a stage has
    its own full/free mbarriers — kl is free once WG0's P·V on it is done, kr once WG1's is, kt
    once both are — and two producer groups of 64 threads (one per stage, cp.async, in the order
    that stage's QK reads it: WG0 reads kl first, WG1 kr) refill a part as soon as it is free, so
    the gather of one block overlaps the math of the other. This is FlashMLA's sparse-prefill
    schedule (its code read to learn, not copied), rebuilt in TileLang. Shared memory: Q 72 KB
    + 2 × 72 KB of keys = 216 KB. 8K tokens: 3.83 ms (609 TFLOP/s; H100 and H200), where
    `simple_kernel` takes 5.18 ms (H200). Q is copied by the two math warpgroups only:
    over 384 threads TileLang copies it 2 bytes at a time (ncu: 26 % of the stall samples). O
    leaves through the Q tiles once both warpgroups are past their last QK: 16-byte row stores
    instead of 4-byte fragment stores over 8 rows (2–5 % faster, H200). regs: setmaxnreg of
    WG0, WG1 and the producers (216 × 256 + 72 × 128 = 64,512 registers, the 168 per thread that
    ptxas gives the CTA at launch; setmaxnreg only moves registers between its warpgroups).
    head_blocks > 1: q, O and lse rows in the head-blocked layout (`row_in_memory`)."""
    tilelang, T = tl()
    token_heads = heads
    group, rows_per_token, heads, topk = grouped_shape(heads, topk, group)
    hb, bi, dh = 64, 64, D_V // 2
    assert heads % hb == 0 and topk % (2 * bi) == 0
    nhb, c = heads // hb, scale * LOG2E
    dt, f32 = getattr(T, dtype), T.float32
    n = T.dynamic("num_tokens")  # the rows of Idx: tokens, or token groups (their union)
    nkv = T.dynamic("num_kv")
    nr = T.dynamic("num_rows")
    rows = row_io(T, hb, nr, row_in_memory(token_heads, head_blocks, nr))
    neg = -(2.0**30)

    # Barrier arguments are (buffer, index) pairs: an indexed barrier passed into a macro arrives
    # there as a plain variable, which T.barrier_wait does not take (TileLang 0.1.15).
    @T.macro
    def qk_part(full, fs, parity, q_part, k_part, acc_s):
        T.barrier_wait(full[fs], parity)
        T.fence_proxy_async()
        T.wgmma_gemm(q_part, k_part, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)

    @T.macro
    def softmax(w, p, b):
        """P of block b (warpgroup w's p-th) at the running max after it, into w.p_reg (bf16);
        w.alpha takes O and l from this warpgroup's scale m_acc to that max."""
        T.wait_wgmma(0)
        T.reduce_max(w.acc_s, w.m_new, dim=1, clear=True)
        if b > 0:  # the max after block b−1, the other warpgroup's
            T.barrier_wait(w.ready[1 - b % 2], (p - 1 + b % 2) & 1)
        for h in T.Parallel(hb):
            w.m_prev[h] = T.if_then_else(b > 0, w.m_s[1 - b % 2, h], neg)
        for h in T.Parallel(hb):
            w.m_new[h] = T.max(w.m_new[h], w.m_prev[h])
            w.alpha[h] = T.exp2((w.m_acc[h] - w.m_new[h]) * c)
            w.m_acc[h] = w.m_new[h]
        for h, r in T.Parallel(hb, bi):
            w.acc_s[h, r] = T.exp2(w.acc_s[h, r] * c - w.m_new[h] * c)
        T.reduce_sum(w.acc_s, w.rs, dim=1)
        T.copy(w.acc_s, w.p_reg)
        for h in T.Parallel(hb):
            w.l[h] = w.l[h] * w.alpha[h] + w.rs[h]

    @T.macro
    def scale_o(acc, factor):
        for h, d in T.Parallel(hb, dh):
            acc[h, d] = acc[h, d] * factor[h]

    @T.macro
    def mask_scores(w, t, Vis, b):
        # S starts at 0 where the row may see the slot and −inf elsewhere; QK accumulates into it
        for h, r in T.Parallel(hb, bi):
            w.acc_s[h, r] = T.if_then_else(visible(Vis, t, b * bi + r, h, rows_per_token), 0, -T.infinity(f32))

    @T.macro
    def normalise(w, acc, own):
        # l summed over both warpgroups (each kept its own blocks' sums at the final max), O / l
        T.copy(w.l, w.l_s[own, :])
        T.barrier_arrive(w.done[own])
        T.barrier_wait(w.done[1 - own], 0)
        # one reciprocal per row, then products: the 128 IEEE divisions per thread this replaced
        # took 7.5 of the 69.6 us an 8K-token CTA lives (clock64 stamps, H200; 1.5 us after)
        for h in T.Parallel(hb):
            w.l[h] = w.l[h] + w.l_s[1 - own, h]
            w.alpha[h] = T.if_then_else(w.l[h] > 0, 1.0 / w.l[h], 0)
        for h, d in T.Parallel(hb, dh):
            acc[h, d] = acc[h, d] * w.alpha[h]

    @T.macro
    def pv_other(acc, p_tile, v_part, free_v, free_t, fs):
        # O += P·V with the other warpgroup's P from shared memory, then the stage parts are free
        T.wgmma_gemm(p_tile, v_part, acc, policy=T.GemmWarpPolicy.FullRow)
        T.wait_wgmma(0)
        T.barrier_arrive(free_v[fs])
        T.barrier_arrive(free_t[fs])

    @T.macro
    def gather_half(g, KV, Idx, t, b, j, dst, col0, free, full, fs, parity):
        # 64 threads: 64 rows × 32 chunks of 8 channels (columns col0 … col0 + 255), 8 rows' indices at a time
        T.barrier_wait(free[fs], parity)
        col = (j % 32) * 8
        for q4 in T.unroll(4):
            for q in T.unroll(8):
                g.src[q] = T.min(T.max(Idx[t, b * bi + (q4 * 8 + q) * 2 + j // 32], 0), nkv - 1)
            for q in T.unroll(8):
                row = (q4 * 8 + q) * 2 + j // 32
                T.ptx_cp_async(T.access_ptr(dst[row, col], "w", 8),
                               T.access_ptr(KV[g.src[q], col0 + col], "r", 8), 8)
        T.cp_async_barrier_noinc(full[fs])

    @T.macro
    def gather_rope(g, KV, Idx, t, b, j, dst, free, full, fs, parity):
        # 64 threads: 64 rows × 8 chunks
        T.barrier_wait(free[fs], parity)
        col = (j % 8) * 8
        for q in T.unroll(8):
            g.src[q] = T.min(T.max(Idx[t, b * bi + q * 8 + j // 8], 0), nkv - 1)
        for q in T.unroll(8):
            T.ptx_cp_async(T.access_ptr(dst[q * 8 + j // 8, col], "w", 8),
                           T.access_ptr(KV[g.src[q], D_V + col], "r", 8), 8)
        T.cp_async_barrier_noinc(full[fs])

    def math_warpgroup(g):
        # fragments per warpgroup: one shared by both branches is laid out for the first branch's
        # threads and the second branch's loops over it vanish (TileLang 0.1.15)
        return SimpleNamespace(**vars(g), acc_s=T.alloc_fragment([hb, bi], f32), p_reg=T.alloc_fragment([hb, bi], dt),
                               m_new=T.alloc_fragment([hb], f32), m_prev=T.alloc_fragment([hb], f32),
                               m_acc=T.alloc_fragment([hb], f32), alpha=T.alloc_fragment([hb], f32),
                               rs=T.alloc_fragment([hb], f32), l=T.alloc_fragment([hb], f32))

    @T.prim_func
    def main(Q: T.Tensor([nr, D_QK], dt), KV: T.Tensor([nkv, D_QK], dt),
             Idx: T.Tensor([n, topk], T.int32), Vis: T.Tensor([n, topk], T.int32), Cnt: T.Tensor([n], T.int32),
             O: T.Tensor([nr, D_V], dt), Lse: T.Tensor([nr], f32)):
        with T.Kernel(n * nhb, threads=384) as bx:
            g = SimpleNamespace(
                q_l=T.alloc_shared([hb, dh], dt), q_r=T.alloc_shared([hb, dh], dt),
                q_t=T.alloc_shared([hb, D_TAIL], dt),
                m_s=T.alloc_shared([2, hb], f32), l_s=T.alloc_shared([2, hb], f32),
                src=T.alloc_local([8], T.int32),
                full_l=T.alloc_barrier([64, 64]), full_r=T.alloc_barrier([64, 64]), full_t=T.alloc_barrier([64, 64]),
                free_l=T.alloc_barrier([128, 128]), free_r=T.alloc_barrier([128, 128]),
                free_t=T.alloc_barrier([256, 256]),
                ready=T.alloc_barrier([128, 128]), p_ready=T.alloc_barrier([128]), done=T.alloc_barrier([128, 128]))
            w0, w1 = math_warpgroup(g), math_warpgroup(g)
            acc_l = T.alloc_fragment([hb, dh], f32)
            acc_r = T.alloc_fragment([hb, dh], f32)
            kl0 = T.alloc_shared([bi, dh], dt)
            kr0 = T.alloc_shared([bi, dh], dt)
            kt0 = T.alloc_shared([bi, D_TAIL], dt)
            kl1 = T.alloc_shared([bi, dh], dt)
            kr1 = T.alloc_shared([bi, dh], dt)
            kt1 = T.alloc_shared([bi, D_TAIL], dt)
            tx = T.get_thread_binding()
            t, r0 = bx // nhb, bx * hb  # Idx row, first q row
            npairs = T.max(T.ceildiv(Cnt[t], 2 * bi), 1)
            if tx < 256:
                rows.load(Q, r0, 0, g.q_l, dh)  # rows past the end (a short last group): see row_io
                rows.load(Q, r0, dh, g.q_r, dh)
                rows.load(Q, r0, D_V, g.q_t, D_TAIL)
            T.sync_threads()

            if tx < 128:  # WG0: even blocks, O[:, :256]
                T.set_max_nreg(regs[0], 1)
                T.fill(acc_l, 0)
                T.fill(w0.l, 0)
                T.fill(w0.m_acc, neg)
                for p in T.serial(npairs):
                    mask_scores(w0, t, Vis, 2 * p)
                    qk_part(w0.full_l, 0, p & 1, w0.q_l, kl0, w0.acc_s)
                    qk_part(w0.full_r, 0, p & 1, w0.q_r, kr0, w0.acc_s)
                    qk_part(w0.full_t, 0, p & 1, w0.q_t, kt0, w0.acc_s)
                    softmax(w0, p, 2 * p)
                    T.copy(w0.m_new, w0.m_s[0, :])
                    T.barrier_arrive(w0.ready[0])
                    scale_o(acc_l, w0.alpha)
                    T.wgmma_gemm(w0.p_reg, kl0, acc_l, policy=T.GemmWarpPolicy.FullRow)  # own block, P from registers
                    # meanwhile: P(2p) at the max after block 2p+1, into kt0 for WG1
                    T.barrier_wait(w0.ready[1], p & 1)
                    for h in T.Parallel(hb):
                        w0.alpha[h] = T.exp2((w0.m_acc[h] - w0.m_s[1, h]) * c)
                        w0.m_acc[h] = w0.m_s[1, h]
                        w0.l[h] = w0.l[h] * w0.alpha[h]
                    for h, r in T.Parallel(hb, bi):
                        w0.acc_s[h, r] = w0.acc_s[h, r] * w0.alpha[h]
                    T.copy(w0.acc_s, kt0)
                    T.fence_proxy_async()
                    T.barrier_arrive(w0.p_ready[0])
                    T.barrier_arrive(w0.free_t[0])
                    T.wait_wgmma(0)
                    T.barrier_arrive(w0.free_l[0])
                    scale_o(acc_l, w0.alpha)
                    pv_other(acc_l, kt1, kl1, w0.free_l, w0.free_t, 1)  # block 2p+1, WG1's P
                normalise(w0, acc_l, 0)
                # O leaves through the Q tile (both warpgroups are past their last QK once normalise
                # returns): 16-byte row stores instead of 4-byte fragment stores scattered over 8 rows
                T.copy(acc_l, g.q_l)
                rows.store(g.q_l, O, r0, 0, dh)  # safe memory access is off here: row_io bounds it
            elif tx < 256:  # WG1: odd blocks, O[:, 256:], lse
                T.set_max_nreg(regs[1], 1)
                T.fill(acc_r, 0)
                T.fill(w1.l, 0)
                T.fill(w1.m_acc, neg)
                for p in T.serial(npairs):
                    mask_scores(w1, t, Vis, 2 * p + 1)
                    qk_part(w1.full_r, 1, p & 1, w1.q_r, kr1, w1.acc_s)  # kr1 frees first for WG1
                    qk_part(w1.full_l, 1, p & 1, w1.q_l, kl1, w1.acc_s)
                    qk_part(w1.full_t, 1, p & 1, w1.q_t, kt1, w1.acc_s)
                    softmax(w1, p, 2 * p + 1)
                    scale_o(acc_r, w1.alpha)
                    T.wgmma_gemm(w1.p_reg, kr1, acc_r, policy=T.GemmWarpPolicy.FullRow)  # own block, P from registers
                    T.copy(w1.acc_s, kt1)  # P(2p+1) for WG0, beside the GEMM
                    T.copy(w1.m_new, w1.m_s[1, :])
                    T.fence_proxy_async()
                    T.barrier_arrive(w1.ready[1])
                    T.wait_wgmma(0)
                    T.barrier_arrive(w1.free_r[1])
                    T.barrier_arrive(w1.free_t[1])
                    T.barrier_wait(w1.p_ready[0], p & 1)
                    pv_other(acc_r, kt0, kr0, w1.free_r, w1.free_t, 0)  # block 2p, WG0's P at this max
                normalise(w1, acc_r, 1)
                T.copy(acc_r, g.q_r)
                rows.store(g.q_r, O, r0, dh, dh)
                for h in T.Parallel(hb):
                    w1.rs[h] = T.if_then_else(w1.l[h] > 0, T.log2(w1.l[h]) + w1.m_new[h] * c, 0)
                rows.store_row(w1.rs, Lse, r0)
            elif tx < 320:  # producer for stage 0 (block 2p), in the order WG0's QK reads it
                T.set_max_nreg(regs[2], 0)
                for p in T.serial(npairs):
                    gather_half(g, KV, Idx, t, 2 * p, tx - 256, kl0, 0, g.free_l, g.full_l, 0, (p & 1) ^ 1)
                    gather_half(g, KV, Idx, t, 2 * p, tx - 256, kr0, dh, g.free_r, g.full_r, 0, (p & 1) ^ 1)
                    gather_rope(g, KV, Idx, t, 2 * p, tx - 256, kt0, g.free_t, g.full_t, 0, (p & 1) ^ 1)
            else:  # producer for stage 1 (block 2p+1), in WG1's order
                T.set_max_nreg(regs[2], 0)
                for p in T.serial(npairs):
                    gather_half(g, KV, Idx, t, 2 * p + 1, tx - 320, kr1, dh, g.free_r, g.full_r, 1, (p & 1) ^ 1)
                    gather_half(g, KV, Idx, t, 2 * p + 1, tx - 320, kl1, 0, g.free_l, g.full_l, 1, (p & 1) ^ 1)
                    gather_rope(g, KV, Idx, t, 2 * p + 1, tx - 320, kt1, g.free_t, g.full_t, 1, (p & 1) ^ 1)

    # the producers' cp.async targets are computed by hand; TileLang's bounds guards would wrap each
    return compile_kernel(main, out_idx=[-2, -1], TL_DISABLE_SAFE_MEMORY_ACCESS=True)


def active_slots(idx: torch.Tensor) -> torch.Tensor:
    """[T, K] int32 slot indices → [T] int32: 1 + the position of the last non-empty slot (0 for an
    all-empty row). The kernels walk slot blocks only up to there; −1 slots before it stay masked."""
    positions = torch.arange(1, idx.shape[1] + 1, dtype=torch.int32, device=idx.device)
    return torch.where(idx >= 0, positions, 0).amax(dim=1).to(torch.int32)


def walked_slots(idx: torch.Tensor, cnt: torch.Tensor | None, group: int, union=union_slots):
    """What a build made with this group walks, as its (Idx, Vis, Cnt) arguments: one token per CTA,
    the token's own slots (Vis is Idx; Cnt = cnt, or active_slots(idx) if not given); token groups,
    the union of their slots (union(idx, group): its own counts, so cnt is not needed)."""
    if group > 1:
        return union(idx, group)
    return idx, idx, active_slots(idx) if cnt is None else cnt


def uses_seesaw(heads: int, topk: int) -> bool:
    """Which forward `get_kernel` builds: `seesaw_kernel` where its 64-row tiles fill (64-head
    blocks, or token groups below 64 heads) and the slots per CTA are a multiple of 128 (GLM-5:
    top-k 2048), else `simple_kernel`."""
    g = token_group(heads)
    return heads * g % 64 == 0 and topk * g % 128 == 0


@functools.cache
def get_kernel(heads: int, topk: int, scale: float, dtype: str = "bfloat16", head_blocks: int = 1):
    if uses_seesaw(heads, topk):
        return seesaw_kernel(heads, topk, float(scale), dtype=dtype, head_blocks=head_blocks)
    return simple_kernel(heads, topk, float(scale), dtype=dtype, head_blocks=head_blocks)


def compile_fwd(heads: int, topk: int, scale: float, dtype: str = "bfloat16", head_blocks: int = 1) -> None:
    """Build what `fwd` runs for these shapes: the kernel and, for token groups, their union."""
    get_kernel(heads, topk, scale, dtype, head_blocks)
    compile_union(heads, topk)


def heads_of(q: torch.Tensor) -> tuple[int, int]:
    """(heads, head_blocks) of q [T, H, D] (1 block) or head-blocked [P, T, H/P, D]."""
    return (q.shape[1], 1) if q.ndim == 3 else (q.shape[0] * q.shape[2], q.shape[0])


def fwd(q, kv, idx, scale, cnt=None):
    """q [T,H,576] or head-blocked [P,T,H/P,576] (`row_in_memory`), kv [T,576] (both bfloat16 or
    both float16), idx [T,K] int32 (K a multiple of 64, H a power of two ≥ 8), cnt =
    active_slots(idx) if not given → out [T,H,512] (q's dtype), lse [T,H] fp32, or both
    head-blocked like q."""
    h, blocks = heads_of(q)
    dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[q.dtype]
    kernel = get_kernel(h, idx.shape[1], float(scale), dtype, blocks)
    return fwd_call(kernel, token_group(h), q.contiguous(), kv.contiguous(), idx.contiguous(), cnt)


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
