"""Lightning-indexer scores (our TileLang kernel) and top-k for the fused backend.

Math (attention/topk.py has the torch version, `select_topk`, with the same result):
    score[t, s] = Σ_h w[t, h] · relu(q[t, h] · k[s])          (fp32; w already scaled)
    topk[t]     = the `topk` visible keys s (starts[t] ≤ s ≤ t) with the largest scores,
                  flat int64 indices, −1 padded, always `topk` wide.

Queries run in blocks of ROW_BLOCK rows. A block only scores the keys any of its rows can see
(from the earliest start to its last row), so the one T-sized buffer is a [rows, window] fp32
score block — never [T, T] — and causal blocks score half the keys on average. torch.topk then
selects within the block.

Kernel: one CTA per (4 queries, 128 keys). The 4 queries' 32 heads are stacked into one M = 128
wgmma tile against 128 keys (K = 128 channels); relu and the head weight are applied on the fp32
accumulator, the 32 heads of each query are summed through shared memory, and keys outside a
row's window are written as −inf. Key tiles past every row of the block (the causal upper
triangle) skip the GEMM and only write −inf. Rows and keys are dynamic (one build per head count
and head dim); the host pads both to whole tiles.

bf16 only (q, k as the indexer computes them in a bf16 model). fp32 inputs keep the torch path:
a kernel rounding them to bf16 could reorder near-tied keys against the reference.
"""

import functools

import torch

from glm5_bridge.kernels.sparse_mla_fwd import _pass_configs, _tl

ROW_BLOCK = 4096  # rows per torch.topk call: the score block is ROW_BLOCK · window · 4 bytes
QUERIES, KEYS = 4, 128  # queries and keys per CTA


def logits_kernel(heads: int, dim: int, threads: int = 256):
    tilelang, T = _tl()
    m_rows = QUERIES * heads
    assert m_rows % 64 == 0
    bf16, f32 = T.bfloat16, T.float32
    nq = T.dynamic("query_head_rows")  # rows · heads
    n = T.dynamic("rows")
    m = T.dynamic("keys")
    nb = T.dynamic("row_blocks")

    @T.prim_func
    def main(Q: T.Tensor([nq, dim], bf16), K: T.Tensor([m, dim], bf16), W: T.Tensor([nq], f32),
             Ks: T.Tensor([n], T.int32), Ke: T.Tensor([n], T.int32), BlockEnd: T.Tensor([nb], T.int32),
             L: T.Tensor([n, m], f32)):
        with T.Kernel(T.ceildiv(m, KEYS), nb, threads=threads) as (bk, bq):
            q_s = T.alloc_shared([m_rows, dim], bf16)
            k_s = T.alloc_shared([KEYS, dim], bf16)
            s_s = T.alloc_shared([m_rows, KEYS], f32)
            acc = T.alloc_fragment([m_rows, KEYS], f32)
            tot = T.alloc_fragment([QUERIES, KEYS], f32)
            if bk * KEYS < BlockEnd[bq]:
                T.copy(Q[bq * m_rows:(bq + 1) * m_rows, :], q_s)
                T.copy(K[bk * KEYS:(bk + 1) * KEYS, :], k_s)
                T.clear(acc)
                T.gemm(q_s, k_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for r, j in T.Parallel(m_rows, KEYS):
                    s_s[r, j] = T.max(acc[r, j], 0) * W[bq * m_rows + r]
                T.clear(tot)
                for i, j in T.Parallel(QUERIES, KEYS):
                    for h in T.serial(heads):
                        tot[i, j] += s_s[i * heads + h, j]
                for i, j in T.Parallel(QUERIES, KEYS):
                    row = bq * QUERIES + i
                    col = bk * KEYS + j
                    L[row, col] = T.if_then_else((col >= Ks[row]) & (col < Ke[row]), tot[i, j], -T.infinity(f32))
            else:
                for i, j in T.Parallel(QUERIES, KEYS):
                    L[bq * QUERIES + i, bk * KEYS + j] = -T.infinity(f32)

    return tilelang.compile(main, out_idx=[], pass_configs=_pass_configs(tilelang))


@functools.cache
def get_logits_kernel(heads: int, dim: int):
    return logits_kernel(heads, dim)


def _ceil_to(x: int, tile: int) -> int:
    return -(-x // tile) * tile


def reference_logits_kernel(heads: int, dim: int):
    """`logits_kernel` in torch, same arguments and output (for the CPU tests of the host code)."""
    from glm5_bridge.attention.topk import index_scores

    def run(q, k, w, ks, ke, block_end, out):
        s = index_scores(q.view(-1, heads, dim), k, w.view(-1, heads))
        cols = torch.arange(k.shape[0], device=k.device)[None]
        out.copy_(s.masked_fill((cols < ks[:, None]) | (cols >= ke[:, None]), float("-inf")))

    return run


def block_scores(q, k, weights, starts, r0: int, r1: int, kernel=None):
    """Scores of rows [r0, r1) over their key window [w0, r1): (scores [r1 − r0, r1 − w0] fp32 with
    −inf outside each row's window, w0). `kernel`: logits_kernel's signature (default: ours)."""
    heads, dim = q.shape[1:]
    n = r1 - r0
    w0 = int(starts[r0:r1].min())  # one sync per block
    m = r1 - w0
    n_pad, m_pad = _ceil_to(n, QUERIES), _ceil_to(m, KEYS)
    qp = q.new_zeros(n_pad, heads, dim)
    qp[:n] = q[r0:r1]
    kp = k.new_zeros(m_pad, dim)
    kp[:m] = k[w0:r1]
    wp = torch.zeros(n_pad, heads, dtype=torch.float32, device=q.device)
    wp[:n] = weights[r0:r1]
    ks = torch.zeros(n_pad, dtype=torch.int32, device=q.device)
    ke = torch.zeros(n_pad, dtype=torch.int32, device=q.device)  # padding rows: empty window
    ks[:n] = (starts[r0:r1] - w0).to(torch.int32)
    ke[:n] = torch.arange(r0 + 1 - w0, r1 + 1 - w0, dtype=torch.int32, device=q.device)
    block_end = ke.view(-1, QUERIES).amax(1).contiguous()
    scores = torch.empty(n_pad, m_pad, dtype=torch.float32, device=q.device)
    kernel = kernel or get_logits_kernel(heads, dim)
    kernel(qp.view(-1, dim), kp, wp.view(-1), ks, ke, block_end, scores)
    return scores[:n, :m], w0


def select_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, starts: torch.Tensor,
                topk: int, row_block: int = ROW_BLOCK, kernel=None) -> torch.Tensor:
    """attention/topk.select_topk's contract ([T, topk] int64 flat indices, −1 padded) with the
    scores from our kernel; non-bf16 or CPU inputs go to the torch version unchanged. `kernel`
    replaces the score kernel (reference_logits_kernel runs this host code on the CPU)."""
    from glm5_bridge.attention import topk as torch_topk

    if kernel is None and not (q.is_cuda and q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16):
        return torch_topk.select_topk(q, k, weights, starts, topk)
    total = k.shape[0]
    out = torch.full((total, topk), -1, dtype=torch.int64, device=k.device)
    q, k, weights = q.contiguous(), k.contiguous(), weights.float()
    for r0 in range(0, total, row_block):
        r1 = min(r0 + row_block, total)
        scores, w0 = block_scores(q, k, weights, starts, r0, r1, kernel)
        best, idx = scores.topk(min(topk, scores.shape[1]), dim=-1, sorted=False)
        out[r0:r1, :idx.shape[1]] = (idx + w0).masked_fill(best == float("-inf"), -1)
    return out
