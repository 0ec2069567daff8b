"""Fused DSA kernels behind one narrow interface. Everything that touches TileLang lives here.

All functions work on the flat token layout of attention/topk.py: the T tokens of every packed
sequence laid end to end, top-k given as flat key indices, −1 for an empty slot.

sparse_mla(q [T,H,576], kv [T,576], topk [T,K] int, softmax_scale, v_dim=512) → [T,H,512]
    Absorbed-latent sparse MLA over the selected keys, differentiable in q and kv
    (`SparseMLA`, a torch.autograd.Function: one fused forward kernel that also returns the
    log-sum-exp; backward = a delta pre-pass (Σ o·do per row and head) + one fused kernel that
    writes dq and accumulates dkv in fp32).
      q  = q_nope·W_UK (512) ‖ roped q_rope (64), per head;
      kv = kv_a_layernorm(latent) (512) ‖ roped k_rope (64), one head shared by all query heads;
      v  = kv[:, :512]; out[t, h] = softmax_k(scale · q[t,h]·kv[topk[t,k]]) · v[topk[t,k]].
    Requirements: CUDA tensors, D = 576 and v_dim = 512 (the kernels are specialised for
    kv_lora_rank 512 + qk_rope_head_dim 64). Anything else is padded internally: heads to a power
    of two ≥ 16 (TP shards of 1–8 heads run), the top-k width to a multiple of 64 with −1, and the
    token count needs no multiple. The kernels compute in bf16 (fp32 softmax statistics and
    accumulators); fp32/fp16 q and kv are rounded to bf16 and the output comes back in q's dtype.
    A row whose slots are all −1 outputs zeros (as the unfused reference does). Rope is not the
    kernels' business: megatron's AbsorbedMLA has already rotated the last 64 channels of q and kv
    before core attention (see attention/backends.py).

lightning-indexer scores + top-k (forward only, no grad)
    Not fused yet: attention/topk.select_topk runs it in torch. A fused version must keep its
    semantics: [T, index_topk] int64 flat indices, capped at the visible keys of each query's own
    sequence, −1 padded, always index_topk wide.

require_tilelang()
    Import check; raises a one-line ImportError naming the install extra.

compile_kernels(heads, topk, softmax_scale, parts)
    Build (or load from TileLang's disk cache) the kernels for one shape, e.g. in parallel
    processes before a run: each kernel compiles in 15–30 s the first time.

Kernel sets (`tilelang_ops()` in sparse_mla.py picks one; $GLM5_DSA_KERNELS overrides):
  "upstream" (default): megatron-core 0.19.2's TileLang sparse-MLA ops (`upstream_ops()`).
  "ours": our forward (kernels/sparse_mla_fwd.py: dynamic token count, one build for every
          length, no padding copies; fp32 reference `fwd_reference` beside it) + upstream's
          backward reading our lse (`ours_ops()`). Device numbers and status: docs/kernels.md.
kernels/reference.py holds a torch version of the same two ops (same arguments, same log2 lse
convention) that the CPU tests run the autograd glue against.
"""

from glm5_bridge.kernels.sparse_mla import (
    D_QK,
    D_V,
    SparseMLA,
    compile_kernels,
    require_tilelang,
    sparse_mla,
    tilelang_ops,
)

__all__ = ["D_QK", "D_V", "SparseMLA", "compile_kernels", "require_tilelang", "sparse_mla", "tilelang_ops"]
