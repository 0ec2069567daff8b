"""Fused sparse MLA (absorbed latent form): input checks, padding to the kernels' tiles, autograd.

The kernels take a batch axis and a kv-group axis that our flat layout does not need: q
[1, T, Hk, 576], kv [1, T, 1, 576], indices [1, T, 1, Kp] int32 (−1 = empty), and return out
[1, T, Hk, 512] (q's dtype) plus lse [1, T, Hk] fp32 in log2 units (log2 Σ exp, the scale folded in;
0 for an all-empty row). `SparseMLA` maps our [T, H, 576] / [T, 576] / [T, K] onto that.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch

from glm5_bridge.kernels._tilelang import D_QK, D_V

TOPK_TILE = 64  # our kernels (and upstream's forward) walk the top-k slots 64 at a time
# Fewest heads a kernel set runs (others are zero-padded up to a power of two at least this). Ours: 8
# (8 heads, TP = 8 of GLM-5, run as groups of 8 tokens filling the 64-row tiles); megatron-core's
# index heads in tiles of a power of two ≥ 16, unguarded.
MIN_HEADS, UPSTREAM_MIN_HEADS = 8, 16

INSTALL_HINT = "pip install glm5-bridge[tilelang]"


def require_tilelang() -> None:
    """Import tilelang or raise a one-line ImportError."""
    try:
        import tilelang  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "tilelang" and e.name is not None:
            raise ImportError(f"dsa_attention_backend='tilelang': tilelang failed to import ({e}); "
                              f"reinstall with {INSTALL_HINT}") from None
        raise ImportError(f"dsa_attention_backend='tilelang' needs the tilelang package: {INSTALL_HINT}") from None
    except (ImportError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ImportError(f"dsa_attention_backend='tilelang': tilelang failed to import ({msg}); "
                          f"reinstall with {INSTALL_HINT}") from None


KERNELS_ENV = "GLM5_DSA_KERNELS"  # "ours" (default) or "upstream"
DEFAULT_KERNELS = "ours"


def default_kernels() -> str:
    """Which kernels `sparse_mla` runs: $GLM5_DSA_KERNELS, else DEFAULT_KERNELS (numbers behind the
    default: docs/kernels.md)."""
    name = os.environ.get(KERNELS_ENV, DEFAULT_KERNELS)
    if name not in ("upstream", "ours"):
        raise ValueError(f"{KERNELS_ENV} must be 'upstream' or 'ours'; got {name!r}")
    return name


def tilelang_ops() -> SimpleNamespace:
    """The kernel entry points `SparseMLA` runs (kernels/reference.py has the same in torch):

    fwd(q, kv, idx, scale, used) → (out in q's dtype, lse fp32)
    bwd(q, kv, out, dout, idx, lse, scale, used) → (dq, dkv), fp32 or q's dtype
    (used: [T] int32, the used slots per row, which `kernel_indices` puts first; ours stop there)
    float16: whether fwd/bwd also take float16 q/kv (else bfloat16 only)

    The default set (`default_kernels()`): ours (`ours_ops`, kernels/sparse_mla_fwd.py and
    sparse_mla_bwd.py) or megatron-core 0.19.2's TileLang ops (`upstream_ops`).
    """
    return ours_ops() if default_kernels() == "ours" else upstream_ops()


@functools.cache
def ours_ops() -> SimpleNamespace:
    """Our kernels: dynamic token count (one build for every length, no padding copies), bfloat16
    or float16, the backward reading the forward's lse instead of recomputing it."""
    require_tilelang()
    from glm5_bridge.kernels import sparse_mla_bwd, sparse_mla_fwd

    def fwd(q, kv, idx, scale, used):
        _, t, h, _ = q.shape
        out, lse = sparse_mla_fwd.fwd(q.view(t, h, D_QK), kv.view(-1, D_QK), idx.view(t, -1), scale, used)
        return out.view(1, t, h, D_V), lse.view(1, t, h)

    def bwd(q, kv, out, dout, idx, lse, scale, used):
        _, t, h, _ = q.shape
        dq, dkv = sparse_mla_bwd.bwd(q.view(t, h, D_QK), kv.view(-1, D_QK), out.view(t, h, D_V),
                                     dout.view(t, h, D_V), idx.view(t, -1), lse.view(t, h), scale, used)
        return dq.view(1, t, h, D_QK), dkv.view(1, -1, 1, D_QK)

    return SimpleNamespace(fwd=fwd, bwd=bwd, bwd_is_ours=True, float16=True, min_heads=MIN_HEADS)


@functools.cache
def upstream_ops() -> SimpleNamespace:
    """megatron-core 0.19.2's TileLang ops (adapted from TileLang's deepseek_v32 examples)."""
    require_tilelang()
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_sparse_mla_bwd as bwd_mod
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_sparse_mla_fwd as fwd_mod

    if not (fwd_mod.HAVE_TILELANG and bwd_mod.HAVE_TILELANG):
        raise ImportError("dsa_attention_backend='tilelang': megatron-core could not load tilelang; "
                          f"reinstall with {INSTALL_HINT}")

    def fwd(q, kv, idx, scale, used=None):  # walks every slot: `used` is not needed
        return fwd_mod.sparse_mla_fwd_interface(q, kv, idx, sm_scale=scale, d_v=D_V)

    def bwd(q, kv, out, dout, idx, lse, scale, used=None):
        delta = bwd_mod.sparse_mla_delta(out, dout)
        return bwd_mod.sparse_mla_bwd(q, kv, None, dout, idx, lse, sm_scale=scale, delta=delta)

    return SimpleNamespace(fwd=fwd, bwd=bwd, bwd_is_ours=False, float16=False, min_heads=UPSTREAM_MIN_HEADS)


def kernel_heads(heads: int, min_heads: int = MIN_HEADS) -> int:
    """Heads the kernels run with: the next power of two, at least min_heads (the set's)."""
    return max(min_heads, 1 << max(heads - 1, 0).bit_length())


def kernel_topk(topk: int) -> int:
    """Top-k slots the kernels run with: a multiple of 64, at least 64."""
    return max(TOPK_TILE, -(-topk // TOPK_TILE) * TOPK_TILE)


def _pad_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[T, H, D] → contiguous [1, T, heads, D], extra heads zero."""
    t, h, d = x.shape
    if h == heads:
        return x.contiguous().view(1, t, h, d)
    padded = x.new_zeros(1, t, heads, d)
    padded[0, :, :h] = x
    return padded


def kernel_indices(topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, K] integer flat indices → ([1, T, 1, Kp] int32, every empty slot exactly −1 and after
    every used one (used slots keep their order); [T] int32 count of used slots per row). Our
    kernels stop at a row's last used slot block, so a query that sees fewer than K keys (the
    first K tokens of every sequence) costs only its own keys, whatever order the indices came in
    (select_topk already puts −1 last; a replayed top-k need not). Attention does not depend on
    slot order. One TileLang kernel on CUDA (slot_order.py), torch on the CPU."""
    from glm5_bridge.kernels.slot_order import used_first

    idx, n_used = used_first(topk, kernel_topk(topk.shape[1]))
    return idx.view(1, topk.shape[0], 1, -1), n_used


FP16_MAX_INPUT = 2.0**14  # float16 tops out at 65504; q·k and p·v accumulate in fp32 inside the kernels
FP16_DOUT_EXP = 10  # backward scales dout so its largest |value| is about 2^10 (see _float16_dout)


def kernel_dtype(q: torch.Tensor, kv: torch.Tensor, ops: SimpleNamespace) -> torch.dtype:
    """The element type the kernels run in. bfloat16 inputs run as they are. fp32 (and fp16)
    inputs run as float16 when the kernel set takes it and the values fit: float16 keeps 10
    mantissa bits to bfloat16's 7, so an fp32 model sees 8× less input/output rounding (tiny
    GLM-5.2: 6.6e-3 → 1.3e-3 max logprob change for exact attention so rounded; docs/tilelang.md)."""
    if q.dtype == torch.bfloat16 or not ops.float16:
        return torch.bfloat16
    if q.dtype == torch.float16 and kv.dtype == torch.float16:
        return torch.float16
    largest = torch.maximum(q.detach().abs().amax(), kv.detach().abs().amax()).item()  # one sync, fp32 only
    return torch.float16 if largest < FP16_MAX_INPUT else torch.bfloat16


def _float16_dout(dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 has 5 exponent bits: the gradient of a loss averaged over many tokens would
    underflow. Scale dout by a power of two (exact) that brings its largest |value| near
    2^FP16_DOUT_EXP; dq and dkv are linear in dout and get divided by the same factor."""
    largest = dout.detach().abs().amax().float()
    exponent = torch.where(largest > 0, torch.floor(torch.log2(largest)), torch.zeros_like(largest))
    factor = torch.exp2(FP16_DOUT_EXP - exponent)
    return (dout.float() * factor).half(), 1.0 / factor


class SparseMLA(torch.autograd.Function):
    """out = sparse MLA(q, kv, topk); gradients for q and kv. `ops` = tilelang_ops() (or
    kernels.reference.OPS), `dtype` = the kernels' element type (kernel_dtype): q/kv are cast to
    it here, the output and the gradients come back in the inputs' dtypes. Saved for backward: q
    (padded if H is not a kernel head count), kv, the int32 indices, the output and lse."""

    @staticmethod
    def forward(ctx, q, kv, topk, softmax_scale, ops, dtype=torch.bfloat16):
        t, h, _ = q.shape
        q4 = _pad_heads(q.to(dtype), kernel_heads(h, ops.min_heads))
        kv4 = kv.to(dtype).contiguous().view(1, kv.shape[0], 1, D_QK)  # as many keys as queries, or more
        idx4, used = kernel_indices(topk)
        out4, lse = ops.fwd(q4, kv4, idx4, softmax_scale, used)
        out = out4[0, :, :h]
        ctx.save_for_backward(q4, kv4, idx4, used, out, lse)
        ctx.softmax_scale, ctx.ops, ctx.input_dtypes = softmax_scale, ops, (q.dtype, kv.dtype)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q4, kv4, idx4, used, out, lse = ctx.saved_tensors
        t, h, _ = out.shape
        heads = q4.shape[2]
        unscale = None
        if out.dtype == torch.float16:
            dout, unscale = _float16_dout(dout)
        # Padded heads get dout = 0, so their delta and every term they add to dkv are 0.
        dq4, dkv4 = ctx.ops.bwd(q4, kv4, _pad_heads(out, heads), _pad_heads(dout.to(out.dtype), heads),
                                idx4, lse, ctx.softmax_scale, used)
        dq, dkv = dq4[0, :, :h], dkv4.view(-1, D_QK)
        if unscale is not None:
            dq, dkv = dq.float() * unscale, dkv.float() * unscale
        return dq.to(ctx.input_dtypes[0]), dkv.to(ctx.input_dtypes[1]), None, None, None, None


def check_inputs(q: torch.Tensor, kv: torch.Tensor, topk: torch.Tensor, v_dim: int) -> None:
    """Raise ValueError, with what to do, for any input the kernels would get wrong."""
    if q.ndim != 3 or kv.ndim != 2 or topk.ndim != 2:
        raise ValueError("tilelang sparse MLA takes the flat layout q [T, H, 576], kv [T, 576], topk [T, K]; got "
                         f"q {tuple(q.shape)}, kv {tuple(kv.shape)}, topk {tuple(topk.shape)}")
    if q.shape[0] != topk.shape[0]:  # kv may hold more rows (token-parallel attention: a rank's queries)
        raise ValueError(f"tilelang sparse MLA: q and topk must have the same row count; got "
                         f"{q.shape[0]}, {topk.shape[0]}")
    if q.shape[-1] != D_QK or kv.shape[-1] != D_QK or v_dim != D_V:
        raise ValueError(
            f"the TileLang sparse-MLA kernels are built for kv_lora_rank {D_V} + qk_rope_head_dim {D_QK - D_V} "
            f"(q/kv {D_QK} wide, v_dim {D_V}); got q {q.shape[-1]}, kv {kv.shape[-1]}, v_dim {v_dim}. "
            "Use dsa_attention_backend='megatron' for other sizes")
    if not (q.is_floating_point() and kv.is_floating_point()):
        raise ValueError(f"tilelang sparse MLA needs floating-point q/kv; got {q.dtype}, {kv.dtype}")
    if topk.is_floating_point() or topk.dtype == torch.bool:
        raise ValueError(f"tilelang sparse MLA needs integer top-k indices; got {topk.dtype}")
    if not (q.is_cuda and kv.is_cuda and topk.is_cuda):
        raise ValueError(f"dsa_attention_backend='tilelang' needs CUDA tensors; got q on {q.device}, kv on "
                         f"{kv.device}, topk on {topk.device}. Use dsa_attention_backend='megatron' on CPU")


def sparse_mla(q: torch.Tensor, kv: torch.Tensor, topk: torch.Tensor, softmax_scale: float,
               v_dim: int = D_V) -> torch.Tensor:
    """Fused sparse MLA: q [R,H,576], kv [T,576], topk [R,K] flat indices (−1 empty) → [R,H,512].
    R = T, or a subset of the T queries (token-parallel attention, attention/token_parallel.py).

    Indices must lie in [0, T) or be negative (every negative index counts as an empty slot);
    callers pass select_topk's output or a replayed top-k checked by attention/topk.check_topk.
    """
    check_inputs(q, kv, topk, v_dim)
    ops = tilelang_ops()
    return SparseMLA.apply(q, kv, topk, float(softmax_scale), ops, kernel_dtype(q, kv, ops))


def compile_kernels(heads: int, topk: int, softmax_scale: float, parts=None, dtype: torch.dtype = torch.bfloat16,
                    kernels: str | None = None) -> None:
    """Build (or load from TileLang's disk cache) the kernels `sparse_mla` will use for `heads`
    query heads, top-k width `topk`, this softmax scale and element type. Each part can be built in
    its own process; later processes then load them from the cache instead of compiling.
    Parts: ours ("fwd", "bwd", "delta", "slots"), upstream ("fwd", "delta", "bwd", "post", "slots"; "slots"
    is ours in both: kernel_indices' reordering, slot_order.py); default all."""
    kernels = kernels or default_kernels()
    ops = ours_ops() if kernels == "ours" else upstream_ops()  # also the import checks
    hk, kp, scale = kernel_heads(heads, ops.min_heads), kernel_topk(topk), float(softmax_scale)
    if kernels == "ours":
        from glm5_bridge.kernels import sparse_mla_bwd, sparse_mla_fwd

        name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        builders = {"fwd": lambda: sparse_mla_fwd.compile_fwd(hk, kp, scale, name),
                    "bwd": lambda: sparse_mla_bwd.compile_bwd(hk, kp, scale, name),
                    "delta": lambda: sparse_mla_bwd.get_delta_kernel(hk, name)}
    else:
        from megatron.core.transformer.experimental_attention_variant.ops import tilelang_sparse_mla_bwd as bwd_mod
        from megatron.core.transformer.experimental_attention_variant.ops import tilelang_sparse_mla_fwd as fwd_mod

        builders = {
            # The arguments sparse_mla_fwd_interface / sparse_mla_bwd use by default.
            "fwd": lambda: fwd_mod._get_sparse_mla_fwd_kernel(heads=hk, dim=D_V, tail_dim=D_QK - D_V, topk=kp,
                                                              kv_group=1, sm_scale=scale, block_I=64, num_stages=2,
                                                              threads=256),
            "delta": lambda: bwd_mod._get_preprocess_kernel(hk, D_V),
            "bwd": lambda: bwd_mod._get_bwd_kernel(hk, D_V, D_QK - D_V, kp, 1, scale,
                                                   bwd_mod._env_int("MCORE_DSA_TILELANG_BWD_MAX_BLOCK_H", 32)),
            "post": lambda: bwd_mod._get_postprocess_kernel(D_V, D_QK - D_V, 1),
        }
    from glm5_bridge.kernels import slot_order

    builders["slots"] = lambda: slot_order.get_used_first_kernel(topk, kp)  # kernel_indices runs it for both sets
    for part in parts or builders:
        if part not in builders:
            raise ValueError(f"compile_kernels: {kernels} kernels have parts {sorted(builders)}; got {part!r}")
        builders[part]()
