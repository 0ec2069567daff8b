"""glm5_bridge/kernels/tilelang_compat.py: each workaround is still needed, and it works.

Item 1 (N-major WGMMA B sliced along K): C = P · V[64:128, :] with V a [128, 512] shared buffer
and the N = 512 columns split between two warpgroups — the shape of the forward's P·V over the
second half of a 128-key block. Without the fix TileLang 0.1.15 gives the second warpgroup the
wrong columns of V (`test_panel_stride_fix_still_needed` fails once TileLang is fixed: then drop
the item); with it the product equals torch's. TileLang's kernel cache does not know about the
fix, so each build here is uncached and the two builds differ in a constant factor.
"""

import pytest
import torch

from glm5_bridge.kernels import tilelang_compat
from glm5_bridge.kernels._tilelang import compile_kernel, tl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def sliced_pv_kernel(factor: float):
    tilelang, T = tl()
    bf16, f32 = T.bfloat16, T.float32

    @T.prim_func
    def main(P: T.Tensor([64, 64], bf16), V: T.Tensor([128, 512], bf16), O: T.Tensor([64, 512], f32)):
        with T.Kernel(1, threads=256) as _:
            p_s = T.alloc_shared([64, 64], bf16)
            v_s = T.alloc_shared([128, 512], bf16)
            acc = T.alloc_fragment([64, 512], f32)
            T.copy(P, p_s)
            T.copy(V, v_s)
            T.clear(acc)
            T.gemm(p_s, v_s[64:128, :], acc, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(64, 512):
                acc[i, j] = acc[i, j] * factor
            T.copy(acc, O)

    return compile_kernel(main, out_idx=[-1])


def sliced_pv_error(fixed: bool, factor: float) -> float:
    import tilelang

    g = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(64, 64, device="cuda", generator=g).bfloat16()
    v = torch.randn(128, 512, device="cuda", generator=g).bfloat16()
    tilelang.disable_cache()
    tilelang_compat.ENABLED = fixed
    try:
        out = sliced_pv_kernel(factor)(p, v)
    finally:
        tilelang_compat.ENABLED = True
        tilelang.enable_cache()
    ref = factor * (p.float() @ v[64:].float())
    return ((out - ref).norm() / ref.norm()).item()


def test_panel_stride_fix_still_needed():
    assert sliced_pv_error(fixed=False, factor=2.0) > 0.5


def test_panel_stride_fix_gives_the_right_product():
    assert sliced_pv_error(fixed=True, factor=1.0) < 1e-5


def test_fixes_apply_only_while_our_kernels_compile():
    from tilelang.cuda.intrinsics.macro.wgmma_macro_generator import TensorCoreIntrinEmitter

    original = TensorCoreIntrinEmitter.wgmma_ss_atom
    with tilelang_compat.applied():
        assert TensorCoreIntrinEmitter.wgmma_ss_atom is not original
    assert TensorCoreIntrinEmitter.wgmma_ss_atom is original
    sliced_pv_error(fixed=True, factor=3.0)  # a build through compile_kernel leaves TileLang as it was
    assert TensorCoreIntrinEmitter.wgmma_ss_atom is original
