"""Our lightning-indexer score kernel + top-k (glm5_bridge/kernels/indexer.py) against the torch
version (attention/topk.select_topk: fp32 scores of the same bf16 q/k), on the GPU.

Top-k sets may legitimately differ where two keys' scores tie to fp32 rounding (the kernel sums
in another order), so the check is on what was selected: per row, the reference scores of our
picks, sorted, equal the reference's own top scores (≤ 1e-5 of the row's largest |score|); the
−1 slots match exactly and every index lies in its query's causal window. Shapes: packed
sequences shorter and longer than top-k, totals not a multiple of the tiles, row blocks smaller
than T (key windows that start mid-block).
"""

import pytest
import torch

from glm5_bridge.kernels.reference import index_scores
from glm5_bridge.model.attention.topk import flat_starts_thd
from glm5_bridge.model.attention.topk import select_topk as torch_select_topk
from glm5_bridge.kernels import indexer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def inputs(lengths, heads, dim, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads, dim, device="cuda", generator=g).bfloat16()
    k = torch.randn(total, dim, device="cuda", generator=g).bfloat16()
    w = torch.randn(total, heads, device="cuda", generator=g) * (heads ** -0.5 * dim ** -0.5)
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0)
    return q, k, w, flat_starts_thd(cu, total)


@pytest.mark.parametrize("lengths,heads,dim,topk,row_block", [
    ([1, 63, 1000, 130, 5003], 32, 128, 2048, indexer.ROW_BLOCK),  # GLM-5 indexer dims
    ([1, 63, 1000, 130, 5003], 32, 128, 2048, 700),
    ([150, 77, 5, 33], 16, 128, 8, 100),  # the GPU tests' tiny model
])
def test_indexer_topk_matches_torch(lengths, heads, dim, topk, row_block):
    q, k, w, starts = inputs(lengths, heads, dim, seed=len(lengths) + topk)
    ours = indexer.select_topk(q, k, w, starts, topk, row_block=row_block)
    ref = torch_select_topk(q, k, w, starts, topk)
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    assert torch.equal((ours < 0).sum(1), (ref < 0).sum(1))
    rows = torch.arange(ours.shape[0], device="cuda")[:, None]
    assert bool(((ours < 0) | ((ours >= starts[:, None]) & (ours <= rows))).all())
    worst = 0.0
    for r0 in range(0, ours.shape[0], 1024):
        r1 = min(r0 + 1024, ours.shape[0])
        scores = index_scores(q[r0:r1], k, w[r0:r1])
        pick = lambda idx: scores.gather(1, idx.clamp(min=0)).masked_fill(idx < 0, 0).sort(1).values  # noqa: E731
        gap = (pick(ours[r0:r1]) - pick(ref[r0:r1])).abs().amax(1) / scores.abs().amax(1).clamp_min(1e-30)
        worst = max(worst, gap.max().item())
    same = (ours.sort(1).values == ref.sort(1).values).all(1).float().mean().item()
    print(f"RESULT indexer lengths={lengths} heads={heads} topk={topk} row_block={row_block} "
          f"rows_identical={same:.4f} worst_score_gap={worst:.2e}")
    assert worst <= 1e-5 and same >= 0.99


@pytest.mark.parametrize("heads", [32, 16])
def test_block_scores_match_torch(heads):
    """The raw score blocks (the kernel's hand-read fragment layout included: SCORE_EPILOGUE)
    against the same blocks from the torch stand-in: equal to fp32 rounding, −inf at exactly the
    same places (outside each row's window, padding rows and keys)."""
    q, k, w, starts = inputs([700, 2100, 37], heads, 128, seed=heads)
    for r0, r1 in ((0, 700), (650, 2837), (2800, 2837)):  # the middle window starts mid-block
        ours = indexer.block_scores(q, k, w, starts, r0, r1)
        ref = indexer.block_scores(q, k, w, starts, r0, r1, indexer.reference_logits_kernel(heads, 128))
        assert ours.shape == ref.shape
        assert torch.equal(torch.isfinite(ours), torch.isfinite(ref))
        fin = torch.isfinite(ref)
        rel = ((ours - ref).abs()[fin].max() / ref[fin].abs().max()).item()
        print(f"RESULT block_scores heads={heads} rows=({r0}, {r1}) rel_err={rel:.2e}")
        assert rel <= 1e-5


def test_indexer_fp32_inputs_take_the_torch_path():
    from glm5_bridge.model.attention.backends import topk_selector

    q, k, w, starts = inputs([40, 30], 16, 128)
    q, k = q.float(), k.float()
    assert torch.equal(topk_selector("tilelang")(q, k, w, starts, 16), torch_select_topk(q, k, w, starts, 16))


def test_indexer_one_build_for_all_lengths():
    before = indexer.get_logits_kernel.cache_info().misses
    for total in (5, 300, 4097):
        q, k, w, starts = inputs([total], 32, 128)
        assert indexer.select_topk(q, k, w, starts, 2048).shape == (total, 2048)
    assert indexer.get_logits_kernel.cache_info().misses - before <= 1
