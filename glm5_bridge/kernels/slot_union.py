"""The union of neighbouring tokens' top-k slots, for the fused backward's token groups.

Below 64 heads the fused backward (sparse_mla_bwd.token_group) runs `group` neighbouring tokens
per CTA over the union of their slots, so a key they share is gathered once and its dKV row summed
over them before one add. This module lists each group's distinct keys and which of its tokens
selected each: `union_slots_torch` (a segmented torch sort: the reference, 2.8 ms at 8K tokens /
16 heads on an H100, run AJ in docs/kernels.md) and `union_slots_triton` (one Triton program per
group: the sort, the runs' token bits and the compaction without leaving it). `union_slots` picks.

Triton, not TileLang, for this one helper: it has a block-wide sort and an interpreter
(TRITON_INTERPRET=1), so the CPU tests run the very kernel the GPU runs.
"""

import torch

EMPTY = torch.iinfo(torch.int32).max  # sorts after every key
TOKEN_BITS = 3  # a key is packed with its token's place in the group: groups of up to 8


def union_slots_torch(idx: torch.Tensor, group: int):
    """idx [T, K] int32 (−1 = empty slot; a token lists a key at most once), T % group == 0 →
    (union [T/group, group·K] int32: each group's distinct keys ascending, −1 after;
    vis [T/group, group·K] int32: bit j set where token j of the group selected that key;
    cnt [T/group] int32: the union's size)."""
    t, k = idx.shape
    cat = idx.view(t // group, group * k)
    keys, order = torch.where(cat >= 0, cat, EMPTY).sort(dim=1)
    valid = keys != EMPTY
    first = torch.ones_like(valid)
    first[:, 1:] = keys[:, 1:] != keys[:, :-1]
    pos = first.long().cumsum(1) - 1  # the key's place in the union
    cnt = (first & valid).sum(1)
    # empty slots all land on place cnt (their run starts there), which stays −1
    union = torch.full_like(cat, -1).scatter_(1, pos, torch.where(valid, keys, -1))
    bits = (1 << (order // k)).int() * valid  # a token selects a key once: the sum is the OR
    vis = torch.zeros(t // group, group * k, dtype=torch.int32, device=idx.device).scatter_add_(1, pos, bits)
    return union, vis, cnt.int()


_KERNEL = None


def _kernel():
    """Build the Triton kernel on first use (importing triton is slow, and CPU runs without
    TRITON_INTERPRET never need it)."""
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def union_kernel(idx_ptr, union_ptr, vis_ptr, cnt_ptr, K: tl.constexpr, GROUP: tl.constexpr,
                         EMPTY: tl.constexpr, TOKEN_BITS: tl.constexpr):
            n: tl.constexpr = GROUP * K
            g = tl.program_id(0).to(tl.int64)
            offs = tl.arange(0, n)
            key = tl.load(idx_ptr + g * n + offs)
            # key·8 + token: sorting brings a key's selections together, each knowing its token
            packed = tl.where(key >= 0, (key << TOKEN_BITS) | (offs // K), EMPTY)
            packed = tl.sort(packed)
            key = packed >> TOKEN_BITS
            valid = packed != EMPTY
            prev = tl.gather(packed, tl.maximum(offs - 1, 0), 0) >> TOKEN_BITS
            first = valid & ((offs == 0) | (prev != key))
            # a run of one key is at most GROUP long (a token lists a key once): OR its tokens' bits
            vis = tl.zeros([n], tl.int32)
            for j in tl.static_range(GROUP):
                other = tl.gather(packed, tl.minimum(offs + j, n - 1), 0)
                same = (other != EMPTY) & ((other >> TOKEN_BITS) == key)
                vis |= tl.where(same, 1 << (other & ((1 << TOKEN_BITS) - 1)), 0)
            pos = tl.cumsum(first.to(tl.int32), 0) - 1
            cnt = tl.sum(first.to(tl.int32), 0)
            tl.store(union_ptr + g * n + pos, key, mask=first)
            tl.store(vis_ptr + g * n + pos, vis, mask=first)
            tl.store(union_ptr + g * n + offs, -1, mask=offs >= cnt)
            tl.store(vis_ptr + g * n + offs, 0, mask=offs >= cnt)
            tl.store(cnt_ptr + g, cnt)

        _KERNEL = union_kernel
    return _KERNEL


def triton_fits(topk: int, group: int, num_kv: int) -> bool:
    """tl.sort sorts a power-of-two block; the packing leaves 28 bits for a key (< num_kv)."""
    n = group * topk
    return n & (n - 1) == 0 and group <= 1 << TOKEN_BITS and num_kv <= 1 << (31 - TOKEN_BITS)


# The Triton kernel serves the backward only once a GPU run has checked it (tests/gpu, run AK);
# until then bwd() uses the torch sort and the benchmark times both.
TRITON_ON_GPU = False


def union_slots(idx: torch.Tensor, group: int, num_kv: int):
    """union_slots_torch's result (keys index a KV of num_kv rows): from the Triton kernel on a GPU
    where it fits (and TRITON_ON_GPU), else from torch."""
    if TRITON_ON_GPU and idx.is_cuda and triton_fits(idx.shape[1], group, num_kv):
        return union_slots_triton(idx, group)
    return union_slots_torch(idx, group)


def union_slots_triton(idx: torch.Tensor, group: int):
    """union_slots_torch's result from one Triton program per group (triton_fits must hold)."""
    t, k = idx.shape
    n = group * k
    if not triton_fits(k, group, 0):
        raise ValueError(f"union_slots_triton: group·top-k = {group}·{k} must be a power of two, group ≤ 8")
    idx = idx.contiguous()
    union = torch.empty(t // group, n, dtype=torch.int32, device=idx.device)
    vis = torch.empty_like(union)
    cnt = torch.empty(t // group, dtype=torch.int32, device=idx.device)
    _kernel()[(t // group,)](idx, union, vis, cnt, K=k, GROUP=group, EMPTY=EMPTY,
                   TOKEN_BITS=TOKEN_BITS, num_warps=8 if n <= 8192 else 16)
    return union, vis, cnt
