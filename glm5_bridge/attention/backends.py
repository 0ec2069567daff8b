"""`dsa_attention_backend` → the sparse-MLA function a layer runs.

Every backend has one signature, `fn(q [T,H,576], kv [T,576], topk [T,K], softmax_scale, v_dim)
→ [T,H,v_dim]`, over the flat token layout described in attention/topk.py.
"""

from __future__ import annotations

BACKENDS = ("megatron", "tilelang")


def get_backend(name: str):
    if name == "megatron":
        from glm5_bridge.attention.unfused import sparse_mla

        return sparse_mla
    if name == "tilelang":
        raise NotImplementedError(
            "dsa_attention_backend='tilelang' is not available in this version; use 'megatron'")
    raise ValueError(f"dsa_attention_backend must be one of {BACKENDS}, got {name!r}")
