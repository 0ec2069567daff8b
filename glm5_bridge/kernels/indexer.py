"""Lightning-indexer scores (our TileLang kernel) and top-k for the fused backend.

Math (attention/topk.py has the torch version, `select_topk`, with the same result):
    score[t, s] = Σ_h w[t, h] · relu(q[t, h] · k[s])          (fp32; w already scaled)
    topk[t]     = the `topk` visible keys s (starts[t] ≤ s ≤ t) with the largest scores,
                  flat int64 indices, −1 padded, always `topk` wide.

Queries run in blocks of ROW_BLOCK rows. A block only scores the keys any of its rows can see
(from the earliest start to its last row), so the one T-sized buffer is a [rows, window] fp32
score block — never [T, T] — and causal blocks score half the keys on average. Our radix select
(radix_topk.py) then takes each row's top-k within the block.

Kernel: one CTA per (4 queries, 512 keys). The 4 queries' 32-head q rows stay in shared memory
while the CTA walks its keys in tiles of 128 (cp.async, double-buffered); per tile one wgmma
[128 keys × (4 queries · 32 heads)] (K = 128 channels), relu and the head weights on the fp32
accumulator, and each query's head sum as a reduction over its 32 columns inside the accumulator
(no fp32 score tile in shared memory); keys outside a row's window are written as −inf. Key
chunks past every row of the block (the causal upper triangle) skip the GEMM and only write −inf.
Rows and keys are dynamic (one build per head count and head dim); the host pads both to whole
tiles. H200, 8K / 32K tokens (run O): 1.06 / 11.5 ms for the score blocks. One N = 128 wgmma per
tile instead of four N = 32 ones (1.58 / 18.6 ms) re-reads the key tile from shared memory once
instead of four times and needs 127 registers instead of 164, so two CTAs share an SM. Other
tile sizes: benchmarks/results/…runLM… and …runO….

bf16 only (q, k as the indexer computes them in a bf16 model). fp32 inputs keep the torch path:
a kernel rounding them to bf16 could reorder near-tied keys against the reference.
"""

import functools

import torch

from glm5_bridge.kernels.sparse_mla_fwd import _pass_configs, _tl

ROW_BLOCK = 4096  # rows per selection call: the score block is ROW_BLOCK · window · 4 bytes
QUERIES = 4  # queries per CTA
KEYS = 128  # keys per GEMM tile
CHUNK = 512  # keys per CTA: CHUNK // KEYS tiles walked with Q resident and K double-buffered


def logits_kernel(heads: int, dim: int, threads: int = 256):
    """Tile sizes are the module's QUERIES / KEYS / CHUNK, which block_scores pads to."""
    tilelang, T = _tl()
    queries, chunk = QUERIES, CHUNK
    m_rows = queries * heads
    assert chunk % KEYS == 0
    bf16, f32 = T.bfloat16, T.float32
    nq = T.dynamic("query_head_rows")  # rows · heads
    n = T.dynamic("rows")
    m = T.dynamic("keys")  # a multiple of chunk (the host pads)
    nb = T.dynamic("row_blocks")

    @T.prim_func
    def main(Q: T.Tensor([nq, dim], bf16), K: T.Tensor([m, dim], bf16), W: T.Tensor([nq], f32),
             Ks: T.Tensor([n], T.int32), Ke: T.Tensor([n], T.int32), BlockEnd: T.Tensor([nb], T.int32),
             L: T.Tensor([n, m], f32)):
        with T.Kernel(T.ceildiv(m, chunk), nb, threads=threads) as (bc, bq):
            q_s = T.alloc_shared([m_rows, dim], bf16)
            k_s = T.alloc_shared([KEYS, dim], bf16)
            w_s = T.alloc_shared([m_rows], f32)
            o_s = T.alloc_shared([queries, KEYS], f32)
            # keys × (query, head): one wgmma with N = queries · heads per tile; each query's head
            # sum is then a reduction over its `heads` columns inside the accumulator
            acc = T.alloc_fragment([KEYS, m_rows], f32)
            tot = T.alloc_fragment([KEYS, queries], f32)
            if bc * chunk < BlockEnd[bq]:
                T.copy(Q[bq * m_rows:(bq + 1) * m_rows, :], q_s)
                T.copy(W[bq * m_rows:(bq + 1) * m_rows], w_s)
                for kt in T.Pipelined(chunk // KEYS, num_stages=2):
                    k0 = bc * chunk + kt * KEYS
                    T.copy(K[k0:k0 + KEYS, :], k_s)
                    T.gemm(k_s, q_s, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    for r, c in T.Parallel(KEYS, m_rows):
                        acc[r, c] = T.max(acc[r, c], 0) * w_s[c]
                    T.reduce_sum(T.reshape(acc, [KEYS, queries, heads]), tot, dim=2)
                    for r, i in T.Parallel(KEYS, queries):
                        o_s[i, r] = tot[r, i]
                    for i, j in T.Parallel(queries, KEYS):
                        row = bq * queries + i
                        L[row, k0 + j] = T.if_then_else((k0 + j >= Ks[row]) & (k0 + j < Ke[row]), o_s[i, j],
                                                        -T.infinity(f32))
            else:  # above every row's causal end: no GEMM
                for i, j in T.Parallel(queries, chunk):
                    L[bq * queries + i, bc * chunk + j] = -T.infinity(f32)

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
    """Scores of rows [r0, r1) over their key window [w0, r1): (scores [n_pad, m_pad] fp32, w0) —
    whole tiles; rows past r1 − r0 and keys outside a row's window are −inf. `kernel`:
    logits_kernel's signature (default: ours)."""
    heads, dim = q.shape[1:]
    n = r1 - r0
    w0 = int(starts[r0:r1].min())  # one sync per block
    m = r1 - w0
    n_pad, m_pad = _ceil_to(n, QUERIES), _ceil_to(m, CHUNK)
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
    return scores, w0


def torch_select(scores, topk: int, out, base: int):
    """radix_topk.select's contract by torch.topk, also for rows shorter than topk (then it fills
    only the first min(topk, columns) slots of `out`)."""
    best, idx = scores[:out.shape[0]].topk(min(topk, scores.shape[1]), dim=-1, sorted=False)
    out[:, :idx.shape[1]] = torch.where(best == float("-inf"), -1, idx + base)
    return out


def select_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, starts: torch.Tensor,
                topk: int, rows: tuple[int, int] | None = None, row_block: int = ROW_BLOCK, kernel=None,
                select=None) -> torch.Tensor:
    """attention/topk.select_topk's contract ([T, topk] int64 flat indices, −1 padded; rows=(a, b):
    queries a … b−1 only) with the scores from our kernel; non-bf16 or CPU inputs go to the torch
    version unchanged. `kernel` replaces the score kernel (reference_logits_kernel runs this host
    code on the CPU); `select` replaces the selection (default: our radix select on the GPU,
    `torch_select` with `kernel`)."""
    from glm5_bridge.attention import topk as torch_topk
    from glm5_bridge.kernels import radix_topk

    if kernel is None and not (q.is_cuda and q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16):
        return torch_topk.select_topk(q, k, weights, starts, topk, rows)
    select = select or (torch_select if kernel is not None else radix_topk.select)
    a, b = rows or (0, k.shape[0])
    out = torch.full((b - a, topk), -1, dtype=torch.int64, device=k.device)
    q, k, weights = q.contiguous(), k.contiguous(), weights.float()
    for r0 in range(a, b, row_block):
        r1 = min(r0 + row_block, b)
        scores, w0 = block_scores(q, k, weights, starts, r0, r1, kernel)
        # A window of at most topk keys is taken whole; torch.topk does that cheaply.
        (select if scores.shape[1] >= topk else torch_select)(scores, topk, out[r0 - a:r1 - a], w0)
    return out
