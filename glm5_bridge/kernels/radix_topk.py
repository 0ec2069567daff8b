"""Exact top-k of each row of an fp32 score block by radix select (our TileLang kernel); it replaces
torch.topk in the indexer (indexer.select_topk).

Contract: scores [n, m] fp32 (m ≥ k; −inf marks keys a row cannot see) → [n, k] int64 column
indices (+ a base offset) of the row's k largest scores in no particular order
(torch.topk(sorted=False)'s set), −1 where the pick is a −inf score. Ties at the k-th value are
broken arbitrarily, like torch. The kernel writes straight into the caller's output rows (the
indexer's flat [T, k] result), so no index tensor is converted or copied afterwards.

How: an fp32 score maps to a uint32 key with the same order (`_ordered`). The k-th largest key is
found digit by digit, most significant first, in three rounds of 11 / 11 / 10 bits: each round
histograms the keys that match the digits fixed so far, and one suffix scan over the histogram
finds the bin holding the k-th key. A last pass writes every key above that threshold and as many
keys equal to it as are still needed. One CTA per row re-reads its row each round (from L1/L2),
so shared memory holds only the 2048-bin histogram and a row may be any length. −inf keys (outside
a row's window) are counted once per thread rather than added one by one: short causal rows are
mostly −inf and would otherwise pile every atomic onto one bin.
H200: selecting from the indexer's score blocks costs 0.44 ms at 8K tokens and 3.4 ms at 32K,
against 1.2 and 8.5 ms for torch.topk(sorted=False) on the same blocks. H100, the whole
select_topk: 1.11 / 14.42 ms at 8K / 32K, 2.08 / 22.50 with torch.topk instead (2026-12-07).
"""

import functools

import torch

from glm5_bridge.kernels._tilelang import compile_kernel, tl

THREADS = 512
ROUNDS = ((21, 11), (10, 11), (0, 10))  # (shift, bits) of each digit, most significant first
BINS = 1 << max(bits for _, bits in ROUNDS)
BINS_PER_THREAD = BINS // THREADS
KEY_NEG_INF = 0x007FFFFF  # _ordered(−inf): the smallest key
SCAN_OFFSETS = tuple(1 << i for i in range(THREADS.bit_length() - 1))  # 1, 2, …, THREADS / 2


def _ordered(T, x):
    """fp32 → uint32 with the same order: flip all bits of negatives, set the sign bit of the rest."""
    bits = T.reinterpret(x, T.uint32)
    return T.if_then_else(x < 0, ~bits, bits | T.uint32(0x80000000))


def select_kernel(topk: int):
    tilelang, T = tl()
    NEG_INF = -T.infinity(T.float32)

    def matches(key, prefix, high):  # key's digits above bit `high` equal the prefix found so far
        return True if high == 32 else (key >> high) == prefix

    def digit(key, shift, bits):
        return T.cast((key >> shift) & ((1 << bits) - 1), T.int32)

    n = T.dynamic("rows")
    m = T.dynamic("cols")
    r = T.dynamic("out_rows")  # ≤ rows: the score block's padding rows get no output
    i32, u32 = T.int32, T.uint32

    @T.prim_func
    def main(S: T.Tensor([n, m], T.float32), Out: T.Tensor([r, topk], T.int64), base: T.int64):
        with T.Kernel(r, threads=THREADS) as row:
            tx = T.get_thread_binding()
            hist = T.alloc_shared([BINS], i32)
            scan = T.alloc_shared([THREADS], i32)
            prefix_s = T.alloc_shared([1], u32)  # the threshold's digits fixed so far
            need_s = T.alloc_shared([1], i32)  # keys still to take among those matching the prefix
            taken = T.alloc_shared([2], i32)  # output slots used: [0] keys above, [1] keys equal
            prefix = T.alloc_var(u32)
            need = T.alloc_var(i32)
            key = T.alloc_var(u32)
            mine = T.alloc_var(i32)
            step = T.alloc_var(i32)
            above = T.alloc_var(i32)
            pos = T.alloc_var(i32)
            ninf = T.alloc_var(i32)  # −inf keys seen by this thread: counted once, not 1 atomic each
            if tx == 0:
                prefix_s[0] = T.uint32(0)
                need_s[0] = topk
                taken[0] = 0
                taken[1] = 0
            for shift, bits in ROUNDS:
                for j in T.serial(BINS_PER_THREAD):
                    hist[tx * BINS_PER_THREAD + j] = 0
                T.sync_threads()
                prefix = prefix_s[0]
                need = need_s[0]
                ninf = 0
                for it in T.serial(T.ceildiv(m, THREADS)):
                    col = it * THREADS + tx
                    if col < m:
                        if S[row, col] == NEG_INF:
                            ninf = ninf + 1
                        else:
                            key = _ordered(T, S[row, col])
                            if matches(key, prefix, shift + bits):
                                T.atomic_add(hist[digit(key, shift, bits)], 1)
                if ninf > 0 and matches(T.uint32(KEY_NEG_INF), prefix, shift + bits):
                    T.atomic_add(hist[digit(T.uint32(KEY_NEG_INF), shift, bits)], ninf)
                T.sync_threads()
                # Thread tx owns the bins_per_thread bins counted down from BINS − 1 − tx·bins_per_thread;
                # an inclusive scan over threads gives each the count in its bins and all above.
                mine = 0
                for j in T.serial(BINS_PER_THREAD):
                    mine = mine + hist[BINS - 1 - tx * BINS_PER_THREAD - j]
                scan[tx] = mine
                T.sync_threads()
                for offset in SCAN_OFFSETS:  # Hillis–Steele, unrolled at trace time
                    step = scan[tx] + T.if_then_else(tx >= offset, scan[tx - offset], 0)
                    T.sync_threads()
                    scan[tx] = step
                    T.sync_threads()
                above = scan[tx] - mine
                if above < need and scan[tx] >= need:  # exactly one thread: the k-th key is in its bins
                    for j in T.serial(BINS_PER_THREAD):
                        b = BINS - 1 - tx * BINS_PER_THREAD - j
                        if above < need and above + hist[b] >= need:
                            prefix_s[0] = (prefix << bits) | T.cast(b, u32)
                            need_s[0] = need - above
                        above = above + hist[b]
                T.sync_threads()
            prefix = prefix_s[0]  # now the whole k-th largest key
            need = need_s[0]  # how many keys equal to it to take
            if prefix == KEY_NEG_INF:  # fewer than topk visible keys: every finite one, then −1s
                for j in T.serial(T.ceildiv(need, THREADS)):
                    if j * THREADS + tx < need:
                        Out[row, topk - need + j * THREADS + tx] = T.int64(-1)
            for it in T.serial(T.ceildiv(m, THREADS)):
                col = it * THREADS + tx
                if col < m and S[row, col] != NEG_INF:
                    key = _ordered(T, S[row, col])
                    if key > prefix:
                        pos = T.atomic_add(taken[0], 1, return_prev=True)
                        Out[row, pos] = base + col
                    elif key == prefix:
                        pos = T.atomic_add(taken[1], 1, return_prev=True)
                        if pos < need:
                            Out[row, topk - need + pos] = base + col

    # Barriers are placed by hand above; TileLang's automatic ones would land inside the
    # data-dependent branches.
    return compile_kernel(main, out_idx=[], base_configs=False, TL_DISABLE_THREAD_STORAGE_SYNC=True)


@functools.cache
def get_select_kernel(topk: int):
    return select_kernel(topk)


def select(scores, topk: int, out=None, base: int = 0):
    """[n, m] fp32 CUDA scores, m ≥ topk → `out` ([r ≤ n, topk] int64, contiguous; allocated if
    None): base + the column of each pick for the first r rows (see the module docstring)."""
    if scores.shape[1] < topk:
        raise ValueError(f"radix_topk.select: scores has {scores.shape[1]} columns, fewer than topk={topk}")
    if out is None:
        out = torch.empty(scores.shape[0], topk, dtype=torch.int64, device=scores.device)
    if out.shape[0] > scores.shape[0] or out.shape[1] != topk or not out.is_contiguous():
        raise ValueError(f"radix_topk.select: out must be contiguous [≤ {scores.shape[0]}, {topk}], "
                         f"got {tuple(out.shape)}")
    get_select_kernel(topk)(scores.contiguous(), out, base)
    return out
