"""Fused sparse MLA (absorbed latent form): input checks, padding to the kernels' tiles, autograd.

The kernels take a batch axis and a kv-group axis that our flat layout does not need: q
[1, T, Hk, 576], kv [1, T, 1, 576], indices [1, T, 1, Kp] int32 (−1 = empty), and return out
[1, T, Hk, 512] (q's dtype) plus lse [1, T, Hk] fp32 in log2 units (log2 Σ exp, the scale folded in;
0 for an all-empty row). `SparseMLA` maps our [T, H, 576] / [T, 576] / [T, K] onto that.

q may also come head-blocked, [P, T, H/P, 576]: block p holds heads p·H/P … of every token, as
token-parallel attention's all-to-all delivers it (model/attention/token_parallel.py); the output
comes back in the same layout. Kernel sets with `head_blocks` read and write that layout in place
(q [P, T, H/P, 576] is then the kernels' q, the first axis P where it was 1); the others, and head
counts the kernels pad, get a transposed copy each way (`rows_by_token` / `rows_head_blocked`).
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
# Whether our kernels take head-blocked q in place (default) or get ops' transposed copies ("0").
# tests/gpu/test_tilelang_backend.py::test_head_blocked_rows_equal_token_rows: out and dq the same
# bits as the flat call, H100; a TP 8 rank's attention fwd + bwd 3.446 → 3.330 ms at 8K (its slowest
# rank; benchmarks/LOG.md run BV).
HEAD_BLOCKS_ENV = "GLM5_DSA_HEAD_BLOCKS"


def ours_take_head_blocks() -> bool:
    return os.environ.get(HEAD_BLOCKS_ENV, "1") != "0"


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
    head_blocks: whether fwd/bwd take q [P, T, H/P, 576] with P > 1 (head-blocked rows, module
    docstring) and return out, lse, dq in that layout

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

    # q [P, T, H/P, 576] goes to our kernels as it is: P = 1 is the flat layout, P > 1 head-blocked
    def fwd(q, kv, idx, scale, used):
        return sparse_mla_fwd.fwd(q, kv.view(-1, D_QK), idx.view(q.shape[1], -1), scale, used)

    def bwd(q, kv, out, dout, idx, lse, scale, used):
        dq, dkv = sparse_mla_bwd.bwd(q, kv.view(-1, D_QK), out, dout, idx.view(q.shape[1], -1), lse, scale, used)
        return dq, dkv.view(1, -1, 1, D_QK)

    return SimpleNamespace(fwd=fwd, bwd=bwd, bwd_is_ours=True, float16=True, min_heads=MIN_HEADS,
                           head_blocks=ours_take_head_blocks())


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

    return SimpleNamespace(fwd=fwd, bwd=bwd, bwd_is_ours=False, float16=False, min_heads=UPSTREAM_MIN_HEADS,
                           head_blocks=False)


def kernel_heads(heads: int, min_heads: int = MIN_HEADS) -> int:
    """Heads the kernels run with: the next power of two, at least min_heads (the set's)."""
    return max(min_heads, 1 << max(heads - 1, 0).bit_length())


def kernel_topk(topk: int) -> int:
    """Top-k slots the kernels run with: a multiple of 64, at least 64."""
    return max(TOPK_TILE, -(-topk // TOPK_TILE) * TOPK_TILE)


def _transpose01(x: torch.Tensor) -> torch.Tensor:
    """x [A, B, ...] → contiguous [B, A, ...]. The copy is strided, so torch runs it element by
    element: bf16 rows go as 8-byte words where their width allows (half the time of 2-byte
    elements at TP 8 × 8K, benchmarks/LOG.md run AY)."""
    if x.shape[-1] * x.element_size() % 8 == 0 and x.stride(-1) == 1 and x.element_size() < 8:
        return x.view(torch.int64).transpose(0, 1).contiguous().view(x.dtype)
    return x.transpose(0, 1).contiguous()


def rows_by_token(x: torch.Tensor) -> torch.Tensor:
    """Head-blocked [P, T, H/P, D] → [T, H, D] (a copy)."""
    p, t, local, d = x.shape
    return _transpose01(x).view(t, p * local, d)


def rows_head_blocked(x: torch.Tensor, blocks: int) -> torch.Tensor:
    """[T, H, D] → head-blocked [P, T, H/P, D] with P = blocks (a copy)."""
    t, h, d = x.shape
    return _transpose01(x.view(t, blocks, h // blocks, d))


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
    it here, the output and the gradients come back in the inputs' dtypes and q's layout (flat
    [T, H, 576] or head-blocked [P, T, H/P, 576], module docstring). Saved for backward: the
    kernels' q (padded if H is not a kernel head count), kv, the int32 indices, the output and lse."""

    @staticmethod
    def forward(ctx, q, kv, topk, softmax_scale, ops, dtype=torch.bfloat16):
        blocks = q.shape[0] if q.ndim == 4 else 1
        heads = q.shape[-2] * blocks
        # in place: the kernels take the head-blocked rows as they lie (no padding, no transposes)
        ctx.in_place = q.ndim == 4 and ops.head_blocks and kernel_heads(heads, ops.min_heads) == heads
        if ctx.in_place:
            qk = q.to(dtype).contiguous()
        else:
            qk = _pad_heads((rows_by_token(q) if q.ndim == 4 else q).to(dtype), kernel_heads(heads, ops.min_heads))
        kv4 = kv.to(dtype).contiguous().view(1, kv.shape[0], 1, D_QK)  # as many keys as queries, or more
        idx4, used = kernel_indices(topk)
        out4, lse = ops.fwd(qk, kv4, idx4, softmax_scale, used)
        out = out4 if ctx.in_place else out4[0, :, :heads]
        ctx.save_for_backward(qk, kv4, idx4, used, out, lse)
        ctx.softmax_scale, ctx.ops, ctx.input_dtypes, ctx.blocks = softmax_scale, ops, (q.dtype, kv.dtype), blocks
        if q.ndim == 4 and not ctx.in_place:
            out = rows_head_blocked(out, blocks)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        qk, kv4, idx4, used, out, lse = ctx.saved_tensors
        unscale = None
        if out.dtype == torch.float16:
            dout, unscale = _float16_dout(dout)
        dout = dout.to(out.dtype)
        if ctx.in_place:
            dq, dkv4 = ctx.ops.bwd(qk, kv4, out, dout.contiguous(), idx4, lse, ctx.softmax_scale, used)
        else:
            if dout.ndim == 4:
                dout = rows_by_token(dout)
            heads, padded = out.shape[1], qk.shape[2]
            # Padded heads get dout = 0, so their delta and every term they add to dkv are 0.
            dq4, dkv4 = ctx.ops.bwd(qk, kv4, _pad_heads(out, padded), _pad_heads(dout, padded),
                                    idx4, lse, ctx.softmax_scale, used)
            dq = dq4[0, :, :heads]
            if ctx.blocks > 1:
                dq = rows_head_blocked(dq, ctx.blocks)
        dkv = dkv4.view(-1, D_QK)
        if unscale is not None:
            dq, dkv = dq.float() * unscale, dkv.float() * unscale
        return dq.to(ctx.input_dtypes[0]), dkv.to(ctx.input_dtypes[1]), None, None, None, None


def check_inputs(q: torch.Tensor, kv: torch.Tensor, topk: torch.Tensor, v_dim: int) -> None:
    """Raise ValueError, with what to do, for any input the kernels would get wrong."""
    if q.ndim not in (3, 4) or kv.ndim != 2 or topk.ndim != 2:
        raise ValueError("tilelang sparse MLA takes the flat layout q [T, H, 576] (or head-blocked [P, T, H/P, 576]), "
                         f"kv [T, 576], topk [T, K]; got q {tuple(q.shape)}, kv {tuple(kv.shape)}, "
                         f"topk {tuple(topk.shape)}")
    if q.shape[-3] != topk.shape[0]:  # kv may hold more rows (token-parallel attention: a rank's queries)
        raise ValueError(f"tilelang sparse MLA: q and topk must have the same row count; got "
                         f"{q.shape[-3]}, {topk.shape[0]}")
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
    """Fused sparse MLA: q [R,H,576], kv [T,576], topk [R,K] flat indices (−1 empty) → [R,H,512];
    q head-blocked [P,R,H/P,576] → [P,R,H/P,512] (module docstring). R = T, or a subset of the T
    queries (token-parallel attention, attention/token_parallel.py).

    Indices must lie in [0, T) or be negative (every negative index counts as an empty slot);
    callers pass select_topk's output or a replayed top-k checked by attention/topk.check_topk.
    """
    check_inputs(q, kv, topk, v_dim)
    ops = tilelang_ops()
    return SparseMLA.apply(q, kv, topk, float(softmax_scale), ops, kernel_dtype(q, kv, ops))


def compile_kernels(heads: int, topk: int, softmax_scale: float, parts=None, dtype: torch.dtype = torch.bfloat16,
                    kernels: str | None = None, head_blocks: int = 1) -> None:
    """Build (or load from TileLang's disk cache) the kernels `sparse_mla` will use for `heads`
    query heads, top-k width `topk`, this softmax scale and element type. Each part can be built in
    its own process; later processes then load them from the cache instead of compiling.
    Parts: ours ("fwd", "bwd", "delta", "slots"), upstream ("fwd", "delta", "bwd", "post", "slots"; "slots"
    is ours in both: kernel_indices' reordering, slot_order.py); default all. head_blocks P > 1 (ours
    only): the fwd / bwd builds reading head-blocked rows [P, T, H/P, 576] (tensor parallelism P's
    token-parallel attention, `ours_take_head_blocks`)."""
    kernels = kernels or default_kernels()
    ops = ours_ops() if kernels == "ours" else upstream_ops()  # also the import checks
    hk, kp, scale = kernel_heads(heads, ops.min_heads), kernel_topk(topk), float(softmax_scale)
    if kernels == "ours":
        from glm5_bridge.kernels import sparse_mla_bwd, sparse_mla_fwd

        name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        builders = {"fwd": lambda: sparse_mla_fwd.compile_fwd(hk, kp, scale, name, head_blocks),
                    "bwd": lambda: sparse_mla_bwd.compile_bwd(hk, kp, scale, name, head_blocks),
                    "delta": lambda: sparse_mla_bwd.get_delta_kernel(hk, name)}
    else:
        if head_blocks != 1:
            raise ValueError("compile_kernels: head_blocks is for our kernels; upstream's take flat rows only")
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
