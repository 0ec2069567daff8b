"""`dsa_attention_backend`: the switch, the optional tilelang import, input validation and the
fused backend's autograd glue — all without a GPU (the kernels themselves: tests/gpu).

The glue test runs `SparseMLA` (head / top-k padding, int32 −1 indices, log2 lse, delta pre-pass,
dkv scatter) on kernels/reference.py's torch ops and checks it against the unfused backend in fp32
on the same bf16 inputs: what stays for the GPU is only whether the kernels compute those two ops.
"""

import sys

import pytest
import torch

from glm5_bridge.model.attention import backends
from glm5_bridge.model.attention.core import SparseMLACoreAttention
from glm5_bridge.model.attention.unfused import sparse_mla as unfused_sparse_mla
from glm5_bridge.kernels import D_QK, D_V, SparseMLA
from glm5_bridge.kernels import reference
from glm5_bridge.testing import load_megatron, megatron_logits, megatron_packed_logits
from glm5_bridge.testing import rel_error as _rel

INSTALL_LINE = "dsa_attention_backend='tilelang' needs the tilelang package: pip install glm5-bridge[tilelang]"


def _inputs(lengths, heads, topk, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads, D_QK, generator=g).to(dtype)
    kv = torch.randn(total, D_QK, generator=g).to(dtype)
    return q, kv, reference.random_causal_topk(lengths, topk, generator=g)


def _cores(model):
    return [m for m in model.modules() if isinstance(m, SparseMLACoreAttention)]


def test_megatron_backend_is_the_unfused_function():
    q, kv, topk = _inputs([9, 7], heads=2, topk=4)
    fn = backends.get_backend("megatron")
    ref = unfused_sparse_mla(q, kv, topk, 0.07, D_V)
    for packed in (True, False):
        assert torch.equal(fn(q, kv, topk, 0.07, D_V, packed=packed), ref)


def test_unknown_backend():
    with pytest.raises(ValueError, match="must be one of"):
        backends.get_backend("flash")


def test_tilelang_missing_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "tilelang", None)  # `import tilelang` fails as if not installed
    with pytest.raises(ImportError) as info:
        backends.get_backend("tilelang")
    assert str(info.value) == INSTALL_LINE
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_model_with_tilelang_backend_fails_at_build_without_the_package(tiny_checkpoint, monkeypatch):
    monkeypatch.setitem(sys.modules, "tilelang", None)
    with pytest.raises(ImportError) as info:
        load_megatron(tiny_checkpoint("GLM-5.2"), dsa_attention_backend="tilelang")
    # megatron's build_module appends "when instantiating …" to the same line
    assert str(info.value).startswith(INSTALL_LINE) and "\n" not in str(info.value)


def test_core_passes_the_layout_and_tilelang_refuses_what_it_cannot_run(tiny_checkpoint):
    """The core attention tells the backend thd vs bshd; the fused backend refuses bshd, and the
    tiny model's 40-wide latent (kernels need 576) with a clear error instead of a wrong answer."""
    _, model = load_megatron(tiny_checkpoint("GLM-5.2"))
    model.eval()
    cores = _cores(model)
    assert len(cores) == 8  # 7 decoder layers + the MTP layer
    seen = []

    def recording(q, kv, topk, scale, v_dim, *, packed):
        seen.append(packed)
        return backends.megatron_sparse_mla(q, kv, topk, scale, v_dim, packed=packed)

    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference_logits = megatron_packed_logits(model, [ids[0, :7], ids[0, 7:]])
        for core in cores:
            core.backend = recording
        packed_logits = megatron_packed_logits(model, [ids[0, :7], ids[0, 7:]])
        assert seen and all(seen)
        seen.clear()
        megatron_logits(model, ids)
        assert seen and not any(seen)
        assert torch.equal(packed_logits, reference_logits)

        for core in cores:
            core.backend = backends.tilelang_sparse_mla
        with pytest.raises(ValueError, match="needs thd packed input"):
            megatron_logits(model, ids)
        with pytest.raises(ValueError, match="built for kv_lora_rank 512"):
            megatron_packed_logits(model, [ids[0, :7], ids[0, 7:]])


def test_tilelang_backend_validates_inputs():
    q, kv, topk = _inputs([5, 3], heads=2, topk=4)
    fn = backends.tilelang_sparse_mla
    with pytest.raises(ValueError, match="needs CUDA tensors; got q on cpu"):
        fn(q, kv, topk, 0.1, D_V, packed=True)
    with pytest.raises(ValueError, match="needs thd packed input"):
        fn(q, kv, topk, 0.1, D_V, packed=False)
    with pytest.raises(ValueError, match="v_dim 256"):
        fn(q, kv, topk, 0.1, 256, packed=True)
    with pytest.raises(ValueError, match="same row count"):
        fn(q, kv, topk[:-1], 0.1, D_V, packed=True)
    with pytest.raises(ValueError, match="integer top-k"):
        fn(q, kv, topk.float(), 0.1, D_V, packed=True)
    with pytest.raises(ValueError, match="flat layout"):
        fn(q[None, None], kv, topk, 0.1, D_V, packed=True)


def test_kernel_indices_put_used_slots_first_and_kernels_stop_after_the_last():
    from glm5_bridge.kernels.ops import kernel_indices
    from glm5_bridge.kernels.sparse_mla_fwd import active_slots

    lengths = [70, 1, 130]
    topk = reference.random_causal_topk(lengths, 100, generator=torch.Generator().manual_seed(3))
    topk[4, 7] = -5  # any negative index is an empty slot
    idx4, counts = kernel_indices(topk)
    idx = idx4[0, :, 0]
    assert idx.shape == (201, 128) and idx.dtype == torch.int32
    for row, got in zip(topk, idx):
        used = row[row >= 0]
        n = len(used)
        assert torch.equal(got[:n].long(), used)  # same keys, same order, first
        assert (got[n:] == -1).all()  # every empty slot is exactly -1, after them
    n_used = (topk >= 0).sum(1)
    assert n_used.min() == 1 and n_used.max() == 100  # rows from 1 visible key to a full top-k
    assert torch.equal(active_slots(idx).long(), n_used)
    assert counts.dtype == torch.int32 and torch.equal(counts.long(), n_used)  # what SparseMLA passes as `used`
    # on the slots as drawn (-1 interleaved) the kernels walk up to the last used slot
    assert torch.equal(active_slots(topk.int()).long(), 100 - (topk >= 0).flip(1).int().argmax(1))
    assert active_slots(torch.full((2, 64), -1, dtype=torch.int32)).tolist() == [0, 0]


def test_heads_pad_to_each_kernel_sets_tile():
    """Our kernels take 8 heads (GLM-5 at TP = 8) as token groups of 8, so heads pad to a power of
    two >= 8; upstream's index 16-head tiles unguarded, so theirs pad to >= 16. The autograd glue
    pads by the set it runs (ops.min_heads): 4 heads reach the reference ops as 8."""
    from glm5_bridge.kernels import reference
    from glm5_bridge.kernels.ops import UPSTREAM_MIN_HEADS, SparseMLA, kernel_heads

    assert [kernel_heads(h) for h in (1, 4, 8, 9, 16, 33, 64, 128)] == [8, 8, 8, 16, 16, 64, 64, 128]
    assert [kernel_heads(h, UPSTREAM_MIN_HEADS) for h in (1, 8, 9, 64)] == [16, 16, 16, 64]
    seen = []  # the q shapes the ops get

    def fwd(q, *args):
        seen.append(q.shape)
        return reference.OPS.fwd(q, *args)

    ops = type(reference.OPS)(**{**vars(reference.OPS), "fwd": fwd})
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(6, 4, D_QK, generator=g), torch.randn(6, D_QK, generator=g)
    idx = torch.tensor([[0, -1], [0, 1], [1, 2], [3, 0], [4, 2], [5, 1]])
    out = SparseMLA.apply(q, kv, idx, 0.1, ops, torch.float32)  # fp32 through: exact to the math
    assert seen == [(1, 6, 8, D_QK)] and out.shape == (6, 4, 512)
    ref = torch.softmax((torch.einsum("thd,tkd->thk", q, kv[idx.clamp(min=0)]) * 0.1)
                        .masked_fill((idx < 0)[:, None], float("-inf")), -1)
    assert torch.allclose(out, torch.einsum("thk,tkc->thc", ref, kv[idx.clamp(min=0)][..., :512]), atol=1e-5)


def test_forward_block_divides_every_kernel_topk():
    """The forward's keys per step (128 at 64 heads and top-k 2048, sparse_mla_fwd.block_keys) divide
    the padded top-k the kernels get, for every head count and top-k the backend accepts: a block
    chosen by the head count alone would be 128 for 64 heads at top-k 320 (a multiple of 64 only)
    and fail the kernel's `topk % block_i` assertion at build time."""
    from glm5_bridge.kernels.ops import kernel_heads, kernel_topk
    from glm5_bridge.kernels.sparse_mla_fwd import block_keys

    for heads in range(1, 129):
        for topk in range(1, 4200, 13):
            h, k = kernel_heads(heads), kernel_topk(topk)
            assert k % block_keys(h, k) == 0, (heads, topk)
    chosen = [block_keys(64, 2048), block_keys(128, 2048), block_keys(64, 320), block_keys(16, 2048)]
    assert chosen == [128, 128, 64, 64]
    assert block_keys(64, 2048, skip_empty=False) == 64  # the benchmark's two-stage baseline


def test_fused_dkv_order_groups_each_threads_columns():
    """The fused backward adds dKV 16 bytes per thread into a channel-permuted dkv (sparse_mla_bwd
    DKV_ADD) and `bwd` undoes it with fused_dkv_order. Pin the layout the CUDA side assumes: a
    permutation within each 16-channel block in which the columns thread q holds of one row
    (2q, 2q+1 of the block's first 8 and of its second 8) land on 4 consecutive floats at 4q."""
    from glm5_bridge.kernels.sparse_mla_bwd import fused_dkv_order

    order = fused_dkv_order()
    assert sorted(order.tolist()) == list(range(D_QK))
    assert torch.equal(order // 16, torch.arange(D_QK) // 16)
    for block in range(D_QK // 16):
        for q in range(4):
            cols = [16 * block + c for c in (2 * q, 2 * q + 1, 8 + 2 * q, 9 + 2 * q)]
            assert order[cols].tolist() == [16 * block + 4 * q + i for i in range(4)]


@pytest.mark.parametrize("group", [2, 4, 8])
def test_union_slots_list_each_groups_keys_once_with_who_selected_them(group):
    """Below 64 heads the forward and the fused backward run `group` neighbouring tokens per CTA over
    the union of their slots (kernels/slot_union.py). Against a per-group Python set: the union
    ascending then −1, bit j of vis where token j selected the key, cnt its size; rows that select
    nothing, −1 interleaved, a group whose union fills every slot, and a short last group (group − 1
    tokens). This is the torch version (the CPU's, and the reference tests/gpu checks the CUDA
    kernel against)."""
    from glm5_bridge.kernels.slot_union import union_slots_reference

    g = torch.Generator().manual_seed(group)
    k = 6
    # each token k distinct keys of 3k, so neighbours share some
    idx = torch.stack([torch.randperm(3 * k, generator=g)[:k] for _ in range(4 * group)]).int()
    idx[1] = -1
    idx[2, ::2] = -1
    idx[-group:] = torch.arange(group * k, dtype=torch.int32).view(group, k) + 100  # a full union
    idx = torch.cat([idx, torch.where(idx[:group - 1] >= 0, idx[:group - 1] + 50, -1)])  # a short last group
    union, vis, cnt = union_slots_reference(idx, group)
    assert union.shape == vis.shape == (5, group * k) and cnt.shape == (5,)
    for gi in range(5):
        who = {}
        for j in range(min(group, idx.shape[0] - gi * group)):
            for key in idx[gi * group + j].tolist():
                if key >= 0:
                    who[key] = who.get(key, 0) | (1 << j)
        keys = sorted(who)
        assert cnt[gi] == len(keys)
        assert union[gi].tolist() == keys + [-1] * (group * k - len(keys))
        assert vis[gi].tolist() == [who[key] for key in keys] + [0] * (group * k - len(keys))
    assert cnt[3] == group * k


def test_walked_slots_are_the_tokens_own_or_their_groups_union():
    """What the kernels walk (sparse_mla_fwd.walked_slots, shared by the forward and backward calls):
    one token per CTA, its own slots with the used counts given or computed; token groups, the
    union of their slots with the union's own counts."""
    from glm5_bridge.kernels.slot_union import union_slots_reference
    from glm5_bridge.kernels.sparse_mla_fwd import walked_slots

    idx = torch.tensor([[5, -1, 2, -1], [0, 1, -1, -1], [-1, -1, -1, -1], [3, 2, 1, 0], [7, -1, -1, 6]],
                       dtype=torch.int32)
    own, vis, cnt = walked_slots(idx, None, 1)
    assert own is idx and vis is idx and cnt.tolist() == [3, 2, 0, 4, 4]
    given = torch.tensor([4, 4, 4, 4, 4], dtype=torch.int32)
    assert walked_slots(idx, given, 1)[2] is given
    for got, want in zip(walked_slots(idx, given, 2), union_slots_reference(idx, 2)):
        assert torch.equal(got, want)
    assert walked_slots(idx, None, 2)[2].tolist() == [4, 4, 2]  # {0, 1, 2, 5}, {0, 1, 2, 3}, {6, 7}


@pytest.mark.parametrize("heads,topk", [(4, 10), (16, 80)])  # padded to 8 heads / 64 slots; exact / 128
def test_fused_autograd_glue_matches_unfused(heads, topk):
    lengths = [20, 17, 13]
    q, kv, idx = _inputs(lengths, heads, topk, seed=heads, dtype=torch.bfloat16)
    idx[5] = -1  # an all-empty row: zeros out, no gradient
    scale = 256 ** -0.5
    q_ref, kv_ref = q.float().requires_grad_(), kv.float().requires_grad_()
    out_ref = unfused_sparse_mla(q_ref, kv_ref, idx, scale, D_V)
    q_k, kv_k = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out = SparseMLA.apply(q_k, kv_k, idx, scale, reference.OPS)
    assert out.shape == (sum(lengths), heads, D_V) and out.dtype == torch.bfloat16
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out_ref.backward(dout.float())
    out.backward(dout)
    assert _rel(out, out_ref) <= 1e-2
    assert _rel(q_k.grad, q_ref.grad) <= 1e-2
    assert _rel(kv_k.grad, kv_ref.grad) <= 1e-2
    assert torch.count_nonzero(out[5]) == 0 and torch.count_nonzero(q_k.grad[5]) == 0
    # The glue must not mix rows: perturbing one sequence's keys leaves the others unchanged.
    kv2 = kv.clone()
    kv2[:20] += 1
    out2 = SparseMLA.apply(q, kv2, idx, scale, reference.OPS)
    assert torch.equal(out2[20:], out.detach()[20:]) and not torch.equal(out2[:20], out.detach()[:20])


def test_fused_autograd_glue_takes_a_subset_of_the_queries():
    """Token-parallel attention (attention/token_parallel.py) hands the fused backend one rank's
    query rows over the full kv: the glue must give those rows' outputs and dq, and their share of
    dkv over all T keys."""
    q, kv, idx = _inputs([20, 17, 13], 4, 10, seed=3, dtype=torch.float32)
    rows = torch.tensor([0, 1, 19, 20, 36, 49])
    full_q, full_kv = q.clone().requires_grad_(), kv.clone().requires_grad_()
    SparseMLA.apply(full_q, full_kv, idx, 0.1, reference.OPS, torch.float32)[rows].sum().backward()
    q_r, kv_r = q[rows].clone().requires_grad_(), kv.clone().requires_grad_()
    out = SparseMLA.apply(q_r, kv_r, idx[rows], 0.1, reference.OPS, torch.float32)
    out.sum().backward()
    assert out.shape == (len(rows), 4, D_V) and kv_r.grad.shape == kv.shape
    assert torch.allclose(q_r.grad, full_q.grad[rows], atol=1e-6)
    assert torch.allclose(kv_r.grad, full_kv.grad, atol=1e-6)


def test_row_in_memory_is_the_head_blocked_layout():
    """The kernels' map from their (token, head) row order to memory (sparse_mla_fwd.row_in_memory)
    against torch's own transpose of [T, H] rows into [P, T, H/P]."""
    from glm5_bridge.kernels.sparse_mla_fwd import row_in_memory

    for tokens, heads, blocks in [(5, 16, 4), (7, 64, 8), (3, 8, 1), (1, 32, 2)]:
        order = torch.arange(tokens * heads)
        blocked = order.view(tokens, blocks, heads // blocks).transpose(0, 1).reshape(-1)
        at = row_in_memory(heads, blocks, tokens * heads)(order)
        assert torch.equal(blocked[at], order), (tokens, heads, blocks)
    with pytest.raises(AssertionError, match="do not split"):
        row_in_memory(12, 8, 96)


@pytest.mark.parametrize("heads,blocks", [(16, 4), (4, 2)])  # 4 heads pad to 8: never in place
@pytest.mark.parametrize("in_place", [True, False])
def test_head_blocked_rows_give_the_flat_rows_results(heads, blocks, in_place):
    """Token-parallel attention hands the backends q head-blocked, [P, R, H/P, 576] (kernels/ops.py):
    the fused glue (ops taking the layout in place, or the transposed-copy fallback) and the unfused
    backend must give the flat call's out, dq and dkv in that layout. The ops see the layout they
    take: in place the head-blocked q as it lies, else [1, R, padded H, 576]."""
    from glm5_bridge.kernels.ops import rows_by_token, rows_head_blocked

    q, kv, idx = _inputs([20, 17, 13], heads, 10, seed=heads)
    dout = torch.randn(50, heads, D_V, generator=torch.Generator().manual_seed(5))
    seen = []

    def fwd(q_, *args):
        seen.append(tuple(q_.shape))
        return reference.OPS.fwd(q_, *args)

    ops = type(reference.OPS)(**{**vars(reference.OPS), "fwd": fwd, "head_blocks": in_place})

    def run(q_, dout_, fn):
        q_, kv_ = q_.clone().requires_grad_(), kv.clone().requires_grad_()
        out = fn(q_, kv_)
        out.backward(dout_)
        return out.detach(), q_.grad, kv_.grad

    flat = run(q, dout, lambda q_, kv_: SparseMLA.apply(q_, kv_, idx, 0.1, ops, torch.float32))
    seen.clear()
    blocked = run(rows_head_blocked(q, blocks), rows_head_blocked(dout, blocks),
                  lambda q_, kv_: SparseMLA.apply(q_, kv_, idx, 0.1, ops, torch.float32))
    padded = max(8, heads)
    assert seen == [(blocks, 50, heads // blocks, D_QK) if in_place and heads == padded else (1, 50, padded, D_QK)]
    assert blocked[0].shape == (blocks, 50, heads // blocks, D_V)
    assert torch.allclose(rows_by_token(blocked[0]), flat[0], atol=1e-6)
    assert torch.allclose(rows_by_token(blocked[1]), flat[1], atol=1e-6)
    assert torch.allclose(blocked[2], flat[2], atol=1e-5)
    unfused = lambda q_, kv_: unfused_sparse_mla(q_, kv_, idx, 0.1, D_V)  # noqa: E731
    unfused_blocked = run(rows_head_blocked(q, blocks), rows_head_blocked(dout, blocks), unfused)
    for got, want in zip(unfused_blocked, run(q, dout, unfused)):
        got = rows_by_token(got) if got.ndim == 4 else got
        assert torch.allclose(got, want, atol=1e-5)


def test_fp32_inputs_run_float16_kernels_with_scaled_dout():
    """fp32 q/kv go through the kernels as float16 (kernel_dtype): 8× finer rounding than bf16, and
    a dout far below float16's range (a mean loss over many tokens) still gives exact-scale grads
    thanks to the power-of-two dout scaling. Reference: the unfused backend in fp32."""
    from glm5_bridge.kernels.ops import FP16_MAX_INPUT, kernel_dtype

    lengths, heads, scale = [20, 17, 13], 4, 256 ** -0.5
    q, kv, idx = _inputs(lengths, heads, 40, seed=3)
    assert kernel_dtype(q, kv, reference.OPS) == torch.float16
    assert kernel_dtype(q.bfloat16(), kv.bfloat16(), reference.OPS) == torch.bfloat16
    assert kernel_dtype(q, kv * FP16_MAX_INPUT, reference.OPS) == torch.bfloat16  # would overflow float16
    upstream_like = type(reference.OPS)(**{**vars(reference.OPS), "float16": False})
    assert kernel_dtype(q, kv, upstream_like) == torch.bfloat16
    dout = 1e-9 * torch.randn(sum(lengths), heads, D_V, generator=torch.Generator().manual_seed(2))
    q_ref, kv_ref = q.clone().requires_grad_(), kv.clone().requires_grad_()
    unfused_sparse_mla(q_ref, kv_ref, idx, scale, D_V).backward(dout)
    errors = {}
    for dtype in (torch.float16, torch.bfloat16):
        q_k, kv_k = q.clone().requires_grad_(), kv.clone().requires_grad_()
        out = SparseMLA.apply(q_k, kv_k, idx, scale, reference.OPS, dtype)
        assert out.dtype == torch.float32
        out.backward(dout)
        assert q_k.grad.dtype == kv_k.grad.dtype == torch.float32
        errors[dtype] = (_rel(out, unfused_sparse_mla(q, kv, idx, scale, D_V)), _rel(q_k.grad, q_ref.grad),
                         _rel(kv_k.grad, kv_ref.grad))
    assert max(errors[torch.float16]) <= 2e-3  # measured 3.8e-4 – 5.3e-4 (bf16: 2.9e-3 – 4.3e-3)
    assert all(f * 4 < b for f, b in zip(errors[torch.float16], errors[torch.bfloat16]))


def test_indexer_window_starts_are_each_blocks_min():
    """kernels/indexer.window_starts: every row block's earliest start in one host read, the last
    block short, starts in any order (select_topk's contract promises starts[t] ≤ t, not sorted)."""
    from glm5_bridge.kernels.indexer import window_starts

    starts = torch.tensor([0, 0, 2, 3, 3, 1, 2, 7])  # starts[t] ≤ t, not sorted
    assert window_starts(starts, 1, 7, 4) == [0, 1]  # rows 1-4, then the short block 5-6
    assert window_starts(starts, 2, 8, 3) == [2, 1]
    assert window_starts(starts, 7, 8, 4) == [7]  # one row, padded


def test_row_blocks_keep_the_score_block_within_its_budget():
    """kernels/indexer.row_blocks: contiguous blocks covering [a, b), each block's padded score tiles
    within block_bytes (past its first unit), its w0 the min of its rows' starts; a bigger budget
    takes fewer blocks, up to row_block rows."""
    from glm5_bridge.kernels import indexer

    starts = torch.tensor([0] * 3000 + [3000] * 2000 + [5000] * 7000)  # three packed sequences
    for a, b, budget in [(0, 12000, 4 << 20), (0, 12000, 40 << 20), (4000, 11000, 1 << 20), (0, 100, 1)]:
        blocks = indexer.row_blocks(starts, a, b, row_block=4096, block_bytes=budget)
        assert blocks[0][0] == a and blocks[-1][1] == b
        assert all(x[1] == y[0] for x, y in zip(blocks, blocks[1:]))
        for r0, r1, w0 in blocks:
            assert w0 == int(starts[r0:r1].min()) and r1 - r0 <= 4096
            size = indexer._ceil_to(r1 - r0, indexer.QUERIES) * indexer._ceil_to(r1 - w0, indexer.CHUNK) * 4
            assert size <= budget or r1 - r0 <= indexer.ROW_UNIT, (r0, r1, w0, size)
    assert len(indexer.row_blocks(starts, 0, 12000, block_bytes=4 << 20)) > 12000 // 4096 + 1
    assert len(indexer.row_blocks(starts, 0, 12000, block_bytes=1 << 40)) == 3  # ROW_BLOCK rows each


def test_indexer_top_k_wider_than_the_score_block():
    """kernels/indexer.select_topk when top-k is wider than a block's padded key window (CHUNK
    columns): the block goes to torch_select, which must write −1 into the slots past the window
    (select_topk's result is not pre-filled)."""
    from glm5_bridge.model.attention.topk import flat_starts, select_topk
    from glm5_bridge.kernels import indexer

    lengths, heads, dim, topk = (100, 300), 4, 16, indexer.CHUNK + 88
    g = torch.Generator().manual_seed(9)
    q, k = torch.randn(sum(lengths), heads, dim, generator=g), torch.randn(sum(lengths), dim, generator=g)
    w = torch.randn(sum(lengths), heads, generator=g)
    starts = flat_starts(lengths, "cpu")
    ours = indexer.select_topk(q, k, w, starts, topk, kernel=indexer.reference_logits_kernel(heads, dim))
    assert torch.equal(ours.sort(1).values, select_topk(q, k, w, starts, topk).sort(1).values)


@pytest.mark.parametrize("row_block,block_bytes", [(4096, 64 << 20), (50, 64 << 20), (7, 64 << 20), (4096, 40_000)])
def test_indexer_host_code_matches_torch_topk(row_block, block_bytes):
    """kernels/indexer.select_topk's blocking (row blocks, causal key windows that start mid-block,
    tile padding, window-relative bounds, −1 padding) with a torch stand-in for the score kernel:
    the same top-k as attention/topk.select_topk. The kernel itself: tests/gpu/test_indexer.py."""
    from glm5_bridge.model.attention.topk import flat_starts_thd, select_topk
    from glm5_bridge.kernels import indexer

    lengths, heads, dim, topk = [1, 63, 100, 13, 130], 16, 32, 40
    g = torch.Generator().manual_seed(5)
    total = sum(lengths)
    q, k = torch.randn(total, heads, dim, generator=g), torch.randn(total, dim, generator=g)
    w = torch.randn(total, heads, generator=g) / 16
    starts = flat_starts_thd(torch.tensor([0, *lengths]).cumsum(0), total)
    ours = indexer.select_topk(q, k, w, starts, topk, row_block=row_block, block_bytes=block_bytes,
                               kernel=indexer.reference_logits_kernel(heads, dim))
    ref = select_topk(q, k, w, starts, topk)
    assert torch.equal(ours.sort(1).values, ref.sort(1).values)
    assert torch.equal(backends.topk_selector("tilelang")(q, k, w, starts, topk), ref)  # CPU/fp32: the torch path
    # a tensor-parallel rank's share of the rows (attention/topk.select_topk_split), mid-sequence
    for a, b in [(70, 200), (0, 1), (300, 307)]:
        part = indexer.select_topk(q, k, w, starts, topk, rows=(a, b), row_block=row_block,
                                   block_bytes=block_bytes, kernel=indexer.reference_logits_kernel(heads, dim))
        assert torch.equal(part.sort(1).values, ref[a:b].sort(1).values), (a, b)
