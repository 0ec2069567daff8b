"""Lightning-indexer scores (our TileLang kernel) and top-k for the fused backend.

Math (attention/topk.py has the torch version, `select_topk`, with the same result):
    score[t, s] = Σ_h w[t, h] · relu(q[t, h] · k[s])          (fp32; w already scaled)
    topk[t]     = the `topk` visible keys s (starts[t] ≤ s ≤ t) with the largest scores,
                  flat int64 indices, −1 padded, always `topk` wide.

Queries run in row blocks (`row_blocks`: as many rows, up to ROW_BLOCK, as keep the block's
scores within BLOCK_BYTES). A block only scores the keys any of its rows can see (from the
earliest start to its last row), so the one T-sized buffer is a [rows, window] fp32 score block
of at most BLOCK_BYTES (past one ROW_UNIT of rows), never [T, T], and one block is alive at a
time. Our radix select (radix_topk.py) then takes each row's top-k within the block. Host side
per call: one host read (every ROW_UNIT's window start, `window_starts`); per block an int32 view
of its starts, the score block's allocation and the two kernels — the kernel reads the block's q,
w and window keys where they lie and derives each row's window itself, so nothing is padded or
copied. H100, one process (benchmarks/results/h100_2026-12-07_bench_dsa_targets.json):
select_topk takes 1.11 / 3.71 / 14.42 ms at 8K / 16K / 32K tokens with 0.19 / 0.31 / 0.56 GiB
extra (the int64 result included); 4096-row blocks took 1.12 / 3.56 / 13.97 ms and 0.25 / 0.50 /
1.00 GiB (1.44 GiB at 32K while the previous block was still alive at the next one's
allocation); upstream's TileLang scores + torch.topk 7.87 / 30.35 / 116.47 ms, 4.81 GiB at 32K.
One host read and ~20 small ops (padding copies, bound tensors) per block instead cost 1.41
against 1.06 ms at 8K (H100, same process).

Kernel: one CTA per (4 queries, 512 keys). The 4 queries' 32-head q rows stay in shared memory
while the CTA walks its keys in tiles of 128 (cp.async, double-buffered); per tile one wgmma
[128 keys × (4 queries · 32 heads)] (K = 128 channels), then SCORE_EPILOGUE straight from the
accumulator registers: relu, head weights, each query's head sum (within the thread, then across
the 4 lanes of a quad) and the stores — no score tile in shared memory, no barrier. Keys outside
a row's window are written as −inf; key chunks past every row of a CTA's group (the causal upper
triangle) or before all their sequences' starts (earlier sequences of a packed batch) skip the
GEMM and only write −inf (the second, H100: 1.09 against 1.41 ms for 16K tokens as 16 × 1K,
1–2 % more where nothing is skipped). Rows and keys are dynamic (one build per head count
and head dim); the score block comes in whole tiles, the inputs unpadded. Two CTAs share an SM
(under 128 registers, 99 KB of shared memory).

The register epilogue, against one through a shared-memory score tile (a generic head reduction,
three barriers per tile) in the same process on H100s: 6–11 % faster at 16K / 32K tokens (3.04 /
10.82 ms for the score blocks against 3.35 / 11.77); at 8K no gain could be told from the
machines' drift. ncu (8K, the 4096-row block): tensor pipe 51 % of the elapsed cycles, L1/TEX
(shared memory) 70 %, L2 41 %: the wgmmas read 96 KB of shared-memory operands per 4.2-MFLOP tile
(B, the q rows, once per warpgroup) and cp.async writes 32 KB more, which at the tensor peak
would need all of the SM's 128 B/clock. More queries per CTA (8 or 16, one CTA per SM, the next
group's wgmma in flight during this one's epilogue) cut the L2 traffic by 2–4× but were no
faster. Earlier tile sizes and variants: benchmarks/LOG.md.

bf16 only (q, k as the indexer computes them in a bf16 model). fp32 inputs keep the torch path:
a kernel rounding them to bf16 could reorder near-tied keys against the reference.
"""

import functools

import torch

from glm5_bridge.kernels._tilelang import compile_kernel, tl

ROW_BLOCK = 4096  # most rows per selection call
# The score block's byte budget: a block takes as many rows (in steps of ROW_UNIT, at most
# ROW_BLOCK) as keep rows · window · 4 bytes within it, so the one T-sized buffer shrinks as the
# windows grow (32K tokens: 512 rows, 64 MiB, against 4096 rows and 512 MiB before). The first
# ROW_UNIT rows of a block are taken whatever their window.
BLOCK_BYTES = 64 << 20
ROW_UNIT = 256
QUERIES = 4  # queries per CTA: one wgmma of N = 4 · heads columns per key tile (SCORE_EPILOGUE's quad)
KEYS = 128  # keys per GEMM tile
CHUNK = 512  # keys per CTA: CHUNK // KEYS tiles walked with Q resident and K double-buffered

# The epilogue of one [64 keys × (4 queries · H heads)] wgmma fragment (a warpgroup's half of the
# 128-key tile), straight from registers to the score rows: relu, head weights, the thread's
# partial head sums (H / 4 columns of each query per row), then a reduce-scatter over the 4 lanes
# of a quad (6 shuffles: after it lane q holds query q's two rows), and each lane stores its
# query's scores for rows r and r + 8 — 8 lanes write 32 contiguous bytes per query. No shared
# memory, no barrier. Fragment layout (TileLang 0.1.15, wgmma m64nN): thread t of the warpgroup
# holds rows r = 16·(t / 32) + (t % 32) / 4 and r + 8; acc[4j + e] is row r (e < 2) or r + 8,
# column 8j + 2·(t % 4) + e % 2. tests/gpu/test_indexer.py fails if a release changes it.
SCORE_EPILOGUE = r"""
template <int H>
__device__ __forceinline__ void glm5_index_scores(const float* acc, const float* w, const int* starts,
                                                  int rows_left, int w0, int end0, float* scores,
                                                  long long stride, int key0) {
  constexpr int J = H / 8;  // n8 column blocks per query
  const int tid = threadIdx.x, lane = tid & 31, quad = lane & 3;
  // this lane's query (row quad of the group): its window [ks, ke) in block columns; padding rows
  // (quad ≥ rows_left) get an empty one
  const bool real = quad < rows_left;
  const int ks = real ? starts[quad] - w0 : 0, ke = real ? end0 + quad : 0;
  const int r = 64 * (tid >> 7) + ((tid & 127) >> 5) * 16 + (lane >> 2);
  float part[4][2];
  #pragma unroll
  for (int q = 0; q < 4; ++q) {
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      float s = 0.f;
      #pragma unroll
      for (int j = 0; j < J; ++j) {
        const int blk = q * J + j;
        const float2 wv = *reinterpret_cast<const float2*>(w + 8 * blk + 2 * quad);
        s += fmaxf(acc[4 * blk + 2 * h], 0.f) * wv.x + fmaxf(acc[4 * blk + 2 * h + 1], 0.f) * wv.y;
      }
      part[q][h] = s;
    }
  }
  // lanes with bit 1 set keep queries 2, 3 and send 0, 1; then bit 0 picks one of the two
  const bool hi = quad & 2, odd = quad & 1;
  float keep[2][2];
  #pragma unroll
  for (int a = 0; a < 2; ++a) {
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float mine = hi ? part[2 + a][h] : part[a][h], other = hi ? part[a][h] : part[2 + a][h];
      keep[a][h] = mine + __shfl_xor_sync(0xffffffffu, other, 2);
    }
  }
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float mine = odd ? keep[1][h] : keep[0][h], other = odd ? keep[0][h] : keep[1][h];
    const float total = mine + __shfl_xor_sync(0xffffffffu, other, 1);
    const int key = key0 + r + 8 * h;
    scores[quad * stride + key] = (key >= ks && key < ke) ? total : __int_as_float(0xff800000);  // -inf
  }
}
"""


def logits_kernel(heads: int, dim: int, threads: int = 256):
    """Scores of one row block (block_scores): Q, W, Starts its rows r0 … r0 + nr − 1 as they lie,
    K the keys w0 … of its window as they lie; L [rows padded to QUERIES, keys padded to CHUNK].
    Reads past Q, W and K come back as zeros and score −inf, so nothing is padded or copied."""
    tilelang, T = tl()
    m_rows = QUERIES * heads
    assert CHUNK % KEYS == 0 and heads % 8 == 0 and threads == 256  # SCORE_EPILOGUE's layout
    bf16, f32 = T.bfloat16, T.float32
    nq = T.dynamic("query_head_rows")  # rows · heads
    nr = T.dynamic("rows")
    mk = T.dynamic("window_keys")
    n = T.dynamic("score_rows")  # rows padded to QUERIES
    m = T.dynamic("score_cols")  # window padded to CHUNK

    def group_first(Starts, row, nr):  # min of the group's starts: one expression, built in Python
        first = Starts[row]
        for i in range(1, QUERIES):
            first = T.min(first, T.if_then_else(row + i < nr, Starts[T.min(row + i, nr - 1)], Starts[row]))
        return first

    @T.prim_func
    def main(Q: T.Tensor([nq, dim], bf16), K: T.Tensor([mk, dim], bf16), W: T.Tensor([nq], f32),
             Starts: T.Tensor([nr], T.int32), L: T.Tensor([n, m], f32), w0: T.int32, r0: T.int32):
        with T.Kernel(T.ceildiv(m, CHUNK), T.ceildiv(n, QUERIES), threads=threads, prelude=SCORE_EPILOGUE) as (bc, bq):
            q_s = T.alloc_shared([m_rows, dim], bf16)
            k_s = T.alloc_shared([KEYS, dim], bf16)
            w_s = T.alloc_shared([m_rows], f32)
            # keys × (query, head): each query's head sum is a reduction over its `heads` columns
            acc = T.alloc_fragment([KEYS, m_rows], f32)
            row = bq * QUERIES
            end0 = r0 + row + 1 - w0  # the group's first row sees block columns < end0
            # the earliest key any of the group's rows sees: in a packed batch, chunks before it
            # (earlier sequences) are skipped like those past the causal end
            first = group_first(Starts, row, nr)
            if (bc * CHUNK < end0 - 1 + T.min(QUERIES, nr - row)) and ((bc + 1) * CHUNK > first - w0):
                T.copy(Q[row * heads:(row + QUERIES) * heads, :], q_s)
                T.copy(W[row * heads:(row + QUERIES) * heads], w_s)
                # the copy one step ahead of the GEMM and the epilogue: the next tile's copy goes out
                # at the top of a step (the inferred schedule issued it after the GEMM, between two
                # more barriers: slower at 16K / 32K on an H100)
                for kt in T.Pipelined(CHUNK // KEYS, order=[0, 1, 2], stage=[0, 1, 1]):
                    k0 = bc * CHUNK + kt * KEYS
                    T.copy(K[k0:k0 + KEYS, :], k_s)
                    T.gemm(k_s, q_s, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    T.call_extern("handle", f"glm5_index_scores<{heads}>", acc.data, T.address_of(w_s[0]),
                                  T.address_of(Starts[row]), nr - row, w0, end0, T.address_of(L[row, 0]), m, k0)
            else:  # past every row's causal end, or before every row's sequence: no GEMM
                for i, j in T.Parallel(QUERIES, CHUNK):
                    L[row + i, bc * CHUNK + j] = -T.infinity(f32)

    return compile_kernel(main, out_idx=[])


@functools.cache
def get_logits_kernel(heads: int, dim: int):
    return logits_kernel(heads, dim)


def _ceil_to(x: int, tile: int) -> int:
    return -(-x // tile) * tile


def reference_logits_kernel(heads: int, dim: int):
    """`logits_kernel` in torch, same arguments and output (for the CPU tests of the host code)."""
    from glm5_bridge.kernels.reference import index_scores

    def run(q, k, w, starts, out, w0, r0):
        s = index_scores(q.view(-1, heads, dim), k, w.view(-1, heads))  # [rows, window keys]
        keys = torch.arange(k.shape[0], device=k.device)[None] + w0
        rows = torch.arange(s.shape[0], device=k.device)[:, None] + r0
        out.fill_(float("-inf"))
        out[:s.shape[0], :s.shape[1]] = s.masked_fill((keys < starts[:, None]) | (keys > rows), float("-inf"))

    return run


def block_scores(q, k, weights, starts, r0: int, r1: int, kernel=None, w0: int | None = None, base: int = 0):
    """Scores of rows [r0, r1) over their key window [w0, r1): scores [n_pad, m_pad] fp32 — whole
    tiles; rows past r1 − r0 and keys outside a row's window are −inf. q, k contiguous, weights
    fp32 and contiguous. w0: the window's first key (default: min(starts[r0:r1]), one host read).
    `kernel`: logits_kernel's signature (default: ours). The kernel reads the block's q, w and
    window keys where they lie: no padding copies. base: the row q[0] and weights[0] are."""
    heads, dim = q.shape[1:]
    if w0 is None:
        w0 = int(starts[r0:r1].min())
    scores = torch.empty(_ceil_to(r1 - r0, QUERIES), _ceil_to(r1 - w0, CHUNK), dtype=torch.float32, device=q.device)
    kernel = kernel or get_logits_kernel(heads, dim)
    kernel(q[r0 - base:r1 - base].view(-1, dim), k[w0:r1], weights[r0 - base:r1 - base].view(-1),
           starts[r0:r1].to(torch.int32), scores, w0, r0)
    return scores


def window_starts(starts, a: int, b: int, row_block: int) -> list[int]:
    """min(starts) of each row block of [a, b), for every block with one host read."""
    s = starts[a:b]
    pad = -(b - a) % row_block
    if pad:
        s = torch.nn.functional.pad(s, (0, pad), value=b)  # above every start (starts[t] ≤ t < b)
    return s.view(-1, row_block).amin(1).tolist()


def row_blocks(starts, a: int, b: int, row_block: int = ROW_BLOCK,
               block_bytes: int = BLOCK_BYTES) -> list[tuple[int, int, int]]:
    """The selection's row blocks of queries [a, b): (r0, r1, w0) with w0 the block's first key
    (min of its starts). Units of min(ROW_UNIT, row_block) rows are joined while the block's score
    tiles (rows padded to QUERIES, keys to CHUNK, fp32) stay within block_bytes and its rows within
    row_block. One host read (every unit's first key)."""
    unit = min(ROW_UNIT, row_block)
    firsts = window_starts(starts, a, b, unit)
    blocks, i = [], 0
    while i < len(firsts):
        r0, w0, j = a + i * unit, firsts[i], i + 1
        while j < len(firsts) and (j + 1 - i) * unit <= row_block:
            w, r1 = min(w0, firsts[j]), min(a + (j + 1) * unit, b)
            if _ceil_to(r1 - r0, QUERIES) * _ceil_to(r1 - w, CHUNK) * 4 > block_bytes:
                break
            w0, j = w, j + 1
        blocks.append((r0, min(a + j * unit, b), w0))
        i = j
    return blocks


def torch_select(scores, topk: int, out, base: int):
    """radix_topk.select's contract by torch.topk, also for rows shorter than topk (the slots past
    their columns get −1): like the radix select it writes every slot of `out`."""
    best, idx = scores[:out.shape[0]].topk(min(topk, scores.shape[1]), dim=-1, sorted=False)
    out[:, :idx.shape[1]] = torch.where(best == float("-inf"), -1, idx + base)
    out[:, idx.shape[1]:] = -1
    return out


def accepts(q: torch.Tensor, k: torch.Tensor) -> bool:
    """The score kernel runs bf16 CUDA inputs; the model's backend sends anything else to the torch
    selection (model/attention/backends.py)."""
    return q.is_cuda and q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16


def select_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, starts: torch.Tensor,
                topk: int, rows: tuple[int, int] | None = None, row_block: int = ROW_BLOCK, kernel=None,
                select=None, block_bytes: int = BLOCK_BYTES) -> torch.Tensor:
    """model/attention/topk.select_topk's contract ([T, topk] int64 flat indices, −1 padded;
    rows=(a, b): queries a … b−1 only) with the scores from our kernel (inputs as `accepts` says).
    Row blocks as `row_blocks` plans them (row_block, block_bytes). `kernel` replaces the score
    kernel (reference_logits_kernel runs this host code on the CPU); `select` replaces the selection
    (default: our radix select on the GPU, `torch_select` with `kernel`)."""
    from glm5_bridge.kernels import radix_topk

    if kernel is None and not accepts(q, k):
        raise ValueError(f"the indexer kernel takes bf16 CUDA q and k, got {q.dtype} / {k.dtype} on {q.device}")
    select = select or (torch_select if kernel is not None else radix_topk.select)
    a, b = rows or (0, k.shape[0])
    base = a if q.shape[0] == b - a else 0  # q / weights: all T rows, or just a … b−1 (topk.query_base)
    out = torch.empty((b - a, topk), dtype=torch.int64, device=k.device)  # every select writes all its slots
    q, k, weights = q.contiguous(), k.contiguous(), weights.float().contiguous()
    for r0, r1, w0 in row_blocks(starts, a, b, row_block, block_bytes):
        scores = block_scores(q, k, weights, starts, r0, r1, kernel, w0, base)
        # A window of at most topk keys is taken whole; torch.topk does that cheaply.
        (select if scores.shape[1] >= topk else torch_select)(scores, topk, out[r0 - a:r1 - a], w0)
        del scores  # freed before the next block's allocation: one score block alive at a time
    return out
