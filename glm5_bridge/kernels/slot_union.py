"""Token groups of the sparse-MLA kernels, and the union of their top-k slots.

Below 64 heads the forward (sparse_mla_fwd.simple_kernel) and the fused backward run `group`
neighbouring tokens per CTA (`token_group`) over the union of their slots, so a key they share is
gathered once (and, backward, its dKV row summed over them before one add). This module lists
each group's distinct keys and which of its tokens selected each. `union_slots` is what the
kernels' callers use: on the GPU `union_slots_kernel`, on the CPU `union_slots_reference` (a
segmented torch sort, also the kernel's reference in the tests).

Sorting is the wrong tool: a sort of the group's g·K keys (torch's: 2.8 ms at 8K tokens × 16
heads on an H100, a fifth of the grouped backward; a Triton `tl.sort` per group was no faster)
costs more than the union needs. The keys of a group lie in a narrow
range (causal, one sequence), so `union_slots_kernel` marks them in a map over that range instead,
in windows of WINDOW keys: bit j of map[key − w0] set (shared-memory atomicOr) when token j chose
the key, then the window's set entries compacted in key order, so the union comes out ascending,
as from the sort. 0.1 ms at 8K (H100); tests/test_slot_union_emulated.py checks its logic on
emulated thread blocks on the CPU, tests/gpu against the sort on the GPU.
"""

import functools

import torch

WINDOW = 8192  # map entries per window: 32 KB of shared memory
ROW_TILE = 64  # the sparse-MLA kernels' row tile: min(H, 64) heads per CTA, or a token group's rows


def token_group(heads: int) -> int:
    """Tokens per CTA of the sparse-MLA kernels below 64-head blocks (the forward's simple_kernel,
    the fused backward): 64 // heads neighbouring tokens (8 heads: 8, 16 heads: 4, 32 heads: 2)
    whose (token, head) rows fill the 64-row tiles and who walk the union of their slots, so a key
    they share is gathered once (and, backward, its dKV row summed over them before one add); 1
    from 64 up."""
    return ROW_TILE // heads if heads < ROW_TILE else 1


def grouped_shape(heads: int, topk: int, group: int | None):
    """How a kernel build made for `group` tokens per CTA (default token_group(heads)) sees its
    input: (group, rows_per_token, rows, slots). Above 1 each group is one "token" of group·heads
    rows and group·topk slots (their union), rows_per_token = heads telling a row's token (its bit
    in Vis); for one token per CTA (1, 0, heads, topk)."""
    group = token_group(heads) if group is None else group
    if group == 1:
        return 1, 0, heads, topk
    return group, heads, heads * group, topk * group


# One CTA per group. Thread i holds slots i, i + THREADS, … of the group's G·K (token s / K), of
# which the first n exist (the last group of a token count that is not a multiple of G is short). A
# block-wide min / max gives the keys' range; per window of it: clear the map, OR each key's token
# bit in, then each warp compacts its 1/WARPS of the window in order (32 entries per round, ballot
# + popc) twice: once to count, once, after a prefix sum over the warps, to write.
UNION_GROUP = r"""
template <int K, int G, int THREADS, int W>
__device__ __forceinline__ void glm5_union_group(const int* idx, int n, int* uni, int* vis, int* count) {
  constexpr int N = G * K;
  constexpr int PER = (N + THREADS - 1) / THREADS;
  constexpr int WARPS = THREADS / 32;
  constexpr int SEG = W / WARPS;  // map entries a warp compacts
  static_assert(W % (WARPS * 32) == 0, "window must split into warp rounds");
  __shared__ int map[W];
  __shared__ int warp_lo[WARPS], warp_hi[WARPS], warp_set[WARPS];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int key[PER];
  int lo = 0x7fffffff, hi = -1;
  #pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int s = j * THREADS + tid;
    key[j] = s < n ? idx[s] : -1;
    if (key[j] >= 0) { lo = min(lo, key[j]); hi = max(hi, key[j]); }
  }
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
  if (lane == 0) { warp_lo[warp] = lo; warp_hi[warp] = hi; }
  __syncthreads();
  #pragma unroll
  for (int w = 0; w < WARPS; ++w) { lo = min(lo, warp_lo[w]); hi = max(hi, warp_hi[w]); }
  int written = 0;  // union entries before this window
  for (int w0 = lo; w0 <= hi; w0 += W) {  // lo, hi are the same in every thread: no divergence
    for (int e = tid; e < W; e += THREADS) map[e] = 0;
    __syncthreads();
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int e = key[j] - w0;
      if (key[j] >= 0 && e >= 0 && e < W) atomicOr(&map[e], 1 << ((j * THREADS + tid) / K));
    }
    __syncthreads();
    const int* seg = map + warp * SEG;
    int set = 0;
    for (int r = 0; r < SEG; r += 32) set += __popc(__ballot_sync(0xffffffffu, seg[r + lane] != 0));
    if (lane == 0) warp_set[warp] = set;
    __syncthreads();
    int pos = written, total = 0;
    #pragma unroll
    for (int w = 0; w < WARPS; ++w) { pos += w < warp ? warp_set[w] : 0; total += warp_set[w]; }
    for (int r = 0; r < SEG; r += 32) {
      const int bits = seg[r + lane];
      const unsigned ballot = __ballot_sync(0xffffffffu, bits != 0);
      if (bits) {
        const int at = pos + __popc(ballot & ((1u << lane) - 1u));
        uni[at] = w0 + warp * SEG + r + lane;
        vis[at] = bits;
      }
      pos += __popc(ballot);
    }
    written += total;
    __syncthreads();  // every warp is done with map and warp_set before the next window
  }
  for (int e = written + tid; e < N; e += THREADS) { uni[e] = -1; vis[e] = 0; }
  if (tid == 0) *count = written;
}
"""


def union_slots_reference(idx: torch.Tensor, group: int):
    """idx [T, K] int32 (−1 = empty slot; a token lists a key at most once) → per group of `group`
    neighbouring tokens (G = ⌈T/group⌉ groups, the last one short if group does not divide T):
    (union [G, group·K] int32: the group's distinct keys ascending, −1 after;
    vis [G, group·K] int32: bit j set where token j of the group selected that key;
    cnt [G] int32: the union's size)."""
    t, k = idx.shape
    if t % group:  # the missing tokens select nothing
        idx = torch.cat([idx, idx.new_full((-t % group, k), -1)])
    n = idx.shape[0] // group
    cat = idx.view(n, group * k)
    empty = torch.iinfo(torch.int32).max  # sorts last
    keys, order = torch.where(cat >= 0, cat, empty).sort(dim=1)
    valid = keys != empty
    first = torch.ones_like(valid)
    first[:, 1:] = keys[:, 1:] != keys[:, :-1]
    pos = first.long().cumsum(1) - 1  # the key's place in the union
    cnt = (first & valid).sum(1)
    # empty slots all land on place cnt (their run starts there), which stays −1
    union = torch.full_like(cat, -1).scatter_(1, pos, torch.where(valid, keys, -1))
    bits = (1 << (order // k)).int() * valid  # a token selects a key once: the sum is the OR
    vis = torch.zeros(n, group * k, dtype=torch.int32, device=idx.device).scatter_add_(1, pos, bits)
    return union, vis, cnt.int()


def union_kernel(group: int, topk: int):
    """idx [T, topk] int32 → (union, vis, cnt) as union_slots_reference, written into the given
    [⌈T/group⌉, group·topk] / [⌈T/group⌉] int32 tensors; group ≤ 31 (one bit per token). Dynamic
    token count: one build per (group, topk)."""
    from glm5_bridge.kernels._tilelang import compile_kernel, tl

    tilelang, T = tl()
    assert 1 <= group < 32
    slots = group * topk
    threads = 512 if slots > 8192 else 256  # at most 32 keys in each thread's registers
    nt, n = T.dynamic("num_tokens"), T.dynamic("num_groups")

    @T.prim_func
    def main(Idx: T.Tensor([nt, topk], T.int32), Union: T.Tensor([n, slots], T.int32),
             Vis: T.Tensor([n, slots], T.int32), Cnt: T.Tensor([n], T.int32)):
        with T.Kernel(n, threads=threads, prelude=UNION_GROUP) as g:
            T.call_extern("handle", f"glm5_union_group<{topk}, {group}, {threads}, {WINDOW}>",
                          T.address_of(Idx[g * group, 0]), T.min(nt - g * group, group) * topk,
                          T.address_of(Union[g, 0]), T.address_of(Vis[g, 0]), T.address_of(Cnt[g]))

    return compile_kernel(main, out_idx=[])


@functools.cache
def get_union_kernel(group: int, topk: int):
    return union_kernel(group, topk)


def compile_union(heads: int, topk: int) -> None:
    """Build the union kernel the token groups of `heads` use (none from 64 heads up)."""
    if token_group(heads) > 1:
        get_union_kernel(token_group(heads), topk)


def union_slots_kernel(idx: torch.Tensor, group: int):
    """union_slots_reference's result from the CUDA kernel (idx on the GPU)."""
    t, k = idx.shape
    n = -(-t // group)
    union, vis = (torch.empty(n, group * k, dtype=torch.int32, device=idx.device) for _ in range(2))
    cnt = torch.empty(n, dtype=torch.int32, device=idx.device)
    get_union_kernel(group, k)(idx.contiguous(), union, vis, cnt)
    return union, vis, cnt


def union_slots(idx: torch.Tensor, group: int):
    """What the forward and backward calls run: the CUDA kernel on the GPU, the torch sort elsewhere."""
    return union_slots_kernel(idx, group) if idx.is_cuda else union_slots_reference(idx, group)
