"""Unfused sparse MLA in torch: the reference backend (`dsa_attention_backend="megatron"`).

Works in the absorbed (latent) form the fused kernels use: every head's query is 576-wide
(q_nope·W_UK ‖ q_rope) against one shared 576-wide key (latent ‖ k_rope), and the value is the
first `v_dim` (= kv_lora_rank) channels of that key. Only the top-k selected keys are gathered, so
memory is O(T·topk), not O(T²); autograd flows through the gather to q and kv.
"""

from __future__ import annotations

import torch

# Query rows per chunk: bounds the gathered [rows, topk, 576] block.
ROW_CHUNK = 1024


def sparse_mla(q: torch.Tensor, kv: torch.Tensor, topk: torch.Tensor, softmax_scale: float,
               v_dim: int) -> torch.Tensor:
    """q: [T, H, D], kv: [T, D], topk: [T, K] flat indices (−1 = empty) → [T, H, v_dim]; q
    head-blocked [P, T, H/P, D] (token-parallel attention's rows, kernels/ops.py) → [P, T, H/P, v_dim].

    Softmax runs in fp32 whatever the input dtype (bf16 on GPU); a row whose slots are all empty
    outputs zeros.
    """
    blocked = q.ndim == 4
    if blocked:  # a view with the row axis first: the einsums below take any head axes after it
        q = q.transpose(0, 1)
    total = q.shape[0]
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 for bf16/fp32 inputs, fp64 stays fp64
    # Gather from a full-precision copy: the gather's backward sums every query's contribution
    # into dkv, and that sum in bf16 loses ~3 % (measured on H200 at 8K tokens, 64 heads).
    kv = kv.to(acc)
    outs = []
    for r0 in range(0, total, ROW_CHUNK):
        r1 = min(r0 + ROW_CHUNK, total)
        idx = topk[r0:r1]
        valid = idx >= 0
        kv_sel = kv[idx.clamp(min=0)]  # [rows, K, D]
        logits = torch.einsum("r...d,rkd->r...k", q[r0:r1].to(acc), kv_sel) * softmax_scale
        valid = valid.view(r1 - r0, *[1] * (q.ndim - 2), -1)  # broadcast over the head axes
        # A finite fill keeps all-empty rows NaN-free (forward and backward); exp(min - max) is 0.
        logits = logits.masked_fill(~valid, torch.finfo(logits.dtype).min)
        probs = torch.softmax(logits, dim=-1) * valid
        out = torch.einsum("r...k,rkc->r...c", probs, kv_sel[..., :v_dim])
        outs.append(out.to(q.dtype))
    out = torch.cat(outs, dim=0)
    return out.transpose(0, 1) if blocked else out
