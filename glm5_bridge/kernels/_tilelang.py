"""What every kernel of ours shares: the TileLang import, how a kernel is compiled (pass configs,
with our TileLang fixes applied only while our own kernels compile), and the widths the kernels are
specialised for. A leaf: it imports nothing of glm5_bridge but the fixes beside it."""

from __future__ import annotations

D_QK = 576  # q / kv width: kv_lora_rank 512 ‖ qk_rope_head_dim 64
D_V = 512  # the value is the latent part of kv
D_TAIL = D_QK - D_V  # the roped tail
LOG2E = 1.4426950408889634


def tl():
    """(tilelang, tilelang.language): imported on first use, so CPU-only code never needs them."""
    import tilelang
    import tilelang.language as T

    return tilelang, T


def pass_configs(tilelang) -> dict:
    """No TMA lowering and no automatic warp specialisation: the kernels schedule their copies and
    warpgroups themselves."""
    return {tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
            tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


def compile_kernel(main, out_idx, base_configs: bool = True, **extra_configs):
    """tilelang.compile with our pass configs (without them: `base_configs=False`) plus
    `extra_configs` (PassConfigKey name → value), under tilelang_compat's fixes."""
    from glm5_bridge.kernels import tilelang_compat

    tilelang, _ = tl()
    configs = pass_configs(tilelang) if base_configs else {}
    configs.update({getattr(tilelang.PassConfigKey, name): value for name, value in extra_configs.items()})
    with tilelang_compat.applied():
        return tilelang.compile(main, out_idx=out_idx, pass_configs=configs)
