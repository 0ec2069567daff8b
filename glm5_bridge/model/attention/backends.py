"""`dsa_attention_backend` → the sparse-MLA function a layer runs.

Every backend has one signature, `fn(q [T,H,576], kv [T,576], topk [T,K], softmax_scale, v_dim, *,
packed) → [T,H,v_dim]`, over the flat token layout described in attention/topk.py; `packed` says
whether the micro-batch came as thd (packed sequences) or bshd.

  "megatron"  unfused torch (attention/unfused.py); any device, dtype and layout.
  "tilelang"  fused TileLang kernels (glm5_bridge/kernels); CUDA, thd, q/kv 576 wide with v 512.
              Its package is optional and imported only when this backend is chosen. Its indexer
              scores come from our TileLang kernel too (`topk_selector`; bf16 inputs).

Rope: neither backend applies it. megatron's AbsorbedMLA rotates q_rope and k_rope (interleaved,
rope_interleave=true) and concatenates them after the 512 latent channels before it calls core
attention, and the indexer's rope runs inside DSAIndexer.forward_before_topk. Both backends
therefore see the same already-rotated [latent 512 ‖ rope 64] rows, and the kernels only rely on
that order (value = first 512 channels), so the numerics are the reference's by construction.

Inference: GLM5AbsorbedMLA (attention/mla.py) refuses an inference context before core attention
runs, so no backend ever sees one.
"""

from __future__ import annotations

from glm5_bridge.model.attention.topk import select_topk

BACKENDS = ("megatron", "tilelang")


def megatron_sparse_mla(q, kv, topk, softmax_scale, v_dim, *, packed=False):
    from glm5_bridge.model.attention.unfused import sparse_mla

    return sparse_mla(q, kv, topk, softmax_scale, v_dim)


def tilelang_sparse_mla(q, kv, topk, softmax_scale, v_dim, *, packed):
    """Fused sparse MLA. thd only: bshd input is refused rather than guessed at."""
    if not packed:
        raise ValueError(
            "dsa_attention_backend='tilelang' needs thd packed input (packed_seq_params with qkv_format='thd'); "
            "got bshd. Pack the micro-batch, or use dsa_attention_backend='megatron'")
    from glm5_bridge.kernels import sparse_mla

    return sparse_mla(q, kv, topk, softmax_scale, v_dim)


def fused_select_topk(q, k, weights, starts, topk, rows=None):
    """Our TileLang indexer kernel for bf16 CUDA inputs, the torch selection for the rest (fp32
    inputs keep it: a kernel rounding them to bf16 could reorder near-tied keys)."""
    from glm5_bridge.kernels import indexer

    if indexer.accepts(q, k):
        return indexer.select_topk(q, k, weights, starts, topk, rows)
    return select_topk(q, k, weights, starts, topk, rows)


def topk_selector(name: str):
    """The lightning-indexer top-k a backend runs; every one has attention/topk.select_topk's
    contract. "tilelang" scores bf16 queries with our TileLang kernel (kernels/indexer.py)."""
    return fused_select_topk if name == "tilelang" else select_topk


def get_backend(name: str):
    if name == "megatron":
        return megatron_sparse_mla
    if name == "tilelang":
        from glm5_bridge.kernels import require_tilelang

        require_tilelang()  # one-line ImportError when the optional package is missing
        return tilelang_sparse_mla
    raise ValueError(f"dsa_attention_backend must be one of {BACKENDS}, got {name!r}")
