"""Workarounds for TileLang 0.1.15 bugs our kernels hit. Each item is one context manager, entered
by `applied()` around the compilation of our own kernels only (kernels/_tilelang.compile_kernel):
other TileLang kernels in the process, megatron-core's included, compile unpatched. Each has a GPU
test in tests/gpu/test_tilelang_compat.py that fails once TileLang no longer needs it.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

# --- 1. WGMMA B operand sliced along K, N-major: wrong offset between warpgroups ------------------
# For an N-major ("MN-major") shared B operand TileLang's `wgmma_ss_atom` steps from one 64-column
# swizzle panel to the next by (the GEMM's K extent) × 64 elements. A GEMM over rows j·64 … j·64+63
# of a taller buffer (the forward's P·V over half of a 128-key block) has K = 64 while the
# buffer's panels lie (its row count) × 64 elements apart, so the second warpgroup read the wrong
# columns of V. The descriptor's leading byte offset (computed from the buffer's layout) holds the
# true panel stride; during the atom's emission the K extent it reads is set to that stride / 64.
# K-major A only (the case we use and test). Nothing changes when the operand is not sliced along K
# (checked: our backward and indexer kernels compile to the same CUDA with and without it), and
# megatron-core's TileLang ops, built in the same process by the benchmarks, slice no B along K.

ENABLED = True  # the test switches it off to show that the bug is still there


@contextmanager
def _mn_major_b_panel_stride():
    from tilelang.cuda.intrinsics.macro.wgmma_macro_generator import TensorCoreIntrinEmitter

    emit_atom = TensorCoreIntrinEmitter.wgmma_ss_atom

    def wgmma_ss_atom(self, desc_a, desc_b, C_buf, inst_m_idx, inst_n_idx, ki, a_params, b_params,
                      clear_accum=False):
        b_mn_major, a_k_major = not self.b_transposed, not self.a_transposed
        if not (ENABLED and b_mn_major and a_k_major and not b_params.swizzle_mode.is_none()):
            return emit_atom(self, desc_a, desc_b, C_buf, inst_m_idx, inst_n_idx, ki, a_params, b_params, clear_accum)
        panel_elems = b_params.leading_byte_offset * 16 // b_params.elems_in_bytes  # LBO is in 16-byte units
        chunk = self.chunk
        self.chunk = panel_elems // b_params.swizzle_atom_elems  # the buffer's K extent
        try:
            return emit_atom(self, desc_a, desc_b, C_buf, inst_m_idx, inst_n_idx, ki, a_params, b_params, clear_accum)
        finally:
            self.chunk = chunk

    TensorCoreIntrinEmitter.wgmma_ss_atom = wgmma_ss_atom
    try:
        yield
    finally:
        TensorCoreIntrinEmitter.wgmma_ss_atom = emit_atom


@contextmanager
def applied():
    """Every fix, for the duration of the block (re-entrant: an inner block finds the fix applied
    and applies it around the original again, which it then restores)."""
    with ExitStack() as stack:
        stack.enter_context(_mn_major_b_panel_stride())
        yield
