"""Fused DSA kernels behind one narrow interface. Everything that touches TileLang lives here.

All functions work on the flat token layout of attention/topk.py: the T tokens of every packed
sequence laid end to end, top-k given as flat key indices, −1 for an empty slot.

sparse_mla(q [T,H,576], kv [T,576], topk [T,K] int, softmax_scale, v_dim=512) → [T,H,512]
    Absorbed-latent sparse MLA over the selected keys, differentiable in q and kv (`SparseMLA`, a
    torch.autograd.Function: a forward kernel that also returns the log-sum-exp; a backward that
    reads it instead of recomputing the forward).
      q  = q_nope·W_UK (512) ‖ roped q_rope (64), per head;
      kv = kv_a_layernorm(latent) (512) ‖ roped k_rope (64), one head shared by all query heads;
      v  = kv[:, :512]; out[t, h] = softmax_k(scale · q[t,h]·kv[topk[t,k]]) · v[topk[t,k]].
    Requirements: CUDA tensors, D = 576 and v_dim = 512 (the kernels are specialised for
    kv_lora_rank 512 + qk_rope_head_dim 64). Heads are padded to a power of two ≥ 8 (ours; ≥ 16
    for upstream's), so TP shards of 1–8 heads run; the top-k width to a multiple of 64 with −1;
    any token count. bf16 q/kv run in bf16; fp32 q/kv run in float16 when they fit
    (`kernel_dtype`: 8× finer rounding), with fp32 gradients back. A row whose slots are all −1
    outputs zeros (as the unfused reference does).
    Rope is not the kernels' business: megatron's AbsorbedMLA has already rotated the last 64
    channels of q and kv before core attention (see attention/backends.py).

indexer.select_topk(q [T,Hi,Di], k [T,Di], weights [T,Hi], starts [T], topk) → [T, topk] int64
    The lightning indexer's scores (our TileLang kernel, bf16 inputs) and top-k (our radix-select
    kernel, radix_topk.py) per block of query rows over the keys they can see:
    attention/topk.select_topk's contract (flat indices, capped at the visible keys of each query's
    own sequence, −1 padded, always `topk` wide) without a [T, T] score tensor. fp32 inputs use the
    torch version. Forward only: the indexer trains on no loss of the main model.

require_tilelang()
    Import check; raises a one-line ImportError naming the install extra.

compile_kernels(heads, topk, softmax_scale, parts, dtype, kernels)
    Build (or load from TileLang's disk cache) the kernels for one shape, e.g. in parallel
    processes before a run: each kernel compiles in 10–30 s the first time.

Kernel sets (`tilelang_ops()` in ops.py picks one; $GLM5_DSA_KERNELS overrides):
  "ours" (default): kernels/sparse_mla_fwd.py and sparse_mla_bwd.py — written here from the math,
          fp32 torch references beside them, dynamic token count (one build for every length),
          bf16 or float16. Device numbers and status: docs/kernels.md.
  "upstream": megatron-core 0.19.2's TileLang sparse-MLA ops (`upstream_ops()`; bf16 only).
kernels/reference.py holds a torch version of the same two ops (same arguments, same log2 lse
convention) that the CPU tests run the autograd glue against.
"""

from glm5_bridge.kernels._tilelang import D_QK, D_V
from glm5_bridge.kernels.ops import (
    SparseMLA,
    compile_kernels,
    require_tilelang,
    sparse_mla,
    tilelang_ops,
)

__all__ = ["D_QK", "D_V", "SparseMLA", "compile_kernels", "require_tilelang", "sparse_mla", "tilelang_ops"]
