"""Our radix top-k (glm5_bridge/kernels/radix_topk.py) against torch.topk on the GPU.

Ties at the k-th value may be broken differently, so per row the check is on values: the scores
at our picks, sorted, equal torch.topk's values, sorted, exactly (both are elements of the same
fp32 row); picks are distinct columns, and a pick is −1 exactly where torch's value is −inf.
Rows: random, heavily tied (8 distinct values), with −inf masks leaving fewer than k visible
keys, all −inf, and exactly k columns.
"""

import pytest
import torch

from glm5_bridge.kernels import radix_topk

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def rows(n, m, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    s = torch.randn(n, m, device="cuda", generator=g)
    s[1::4] = torch.randint(-4, 4, (len(range(1, n, 4)), m), device="cuda", generator=g).float()  # ties
    visible = torch.randint(0, m + 1, (n,), device="cuda", generator=g)
    visible[0], visible[-1] = 0, m  # an all −inf row and a full one
    cols = torch.arange(m, device="cuda")
    return s.masked_fill(cols[None] >= visible[:, None], float("-inf"))


@pytest.mark.parametrize("n,m,topk", [(37, 5000, 2048), (9, 2048, 2048), (11, 2049, 2048),
                                      (6, 33000, 2048), (50, 700, 8), (20, 300, 1)])
def test_radix_topk_matches_torch_topk(n, m, topk):
    s = rows(n, m, seed=m + topk)
    picks = radix_topk.select(s, topk)
    best = s.topk(topk, dim=-1).values
    assert picks.shape == (n, topk) and picks.dtype == torch.int64
    assert torch.equal((picks < 0).sum(1), (best == float("-inf")).sum(1))
    got = s.gather(1, picks.clamp(min=0)).masked_fill(picks < 0, float("-inf"))
    assert torch.equal(got.sort(1).values, best.sort(1).values)
    distinct = picks.sort(1).values
    assert bool(((distinct[:, 1:] != distinct[:, :-1]) | (distinct[:, 1:] < 0)).all())
    print(f"RESULT radix_topk n={n} m={m} topk={topk} rows_checked={n}")


def test_radix_topk_writes_offset_rows_in_place():
    """The indexer's use: picks + a base offset into the first rows of a bigger [T, k] result."""
    s = rows(12, 3000, seed=7)
    out = torch.full((20, 16), -7, dtype=torch.int64, device="cuda")
    radix_topk.select(s, 16, out[4:14], base=1000)
    alone = radix_topk.select(s[:10], 16)
    def picked(idx):  # scores at the picks: tied rows may pick different columns of equal score
        return s[:10].gather(1, idx.clamp(min=0)).masked_fill(idx < 0, float("-inf")).sort(1).values
    assert torch.equal(picked(out[4:14] - 1000), picked(alone))
    assert torch.equal((out[4:14] < 0).sum(1), (alone < 0).sum(1))
    assert bool((out[:4] == -7).all()) and bool((out[14:] == -7).all())


def test_radix_topk_one_build_for_all_shapes():
    before = radix_topk.get_select_kernel.cache_info().misses
    for n, m in ((3, 2048), (100, 4097), (7, 20000)):
        radix_topk.select(rows(n, m, seed=n), 2048)
    assert radix_topk.get_select_kernel.cache_info().misses - before <= 1


def test_radix_topk_rejects_short_rows():
    with pytest.raises(ValueError, match="fewer than topk"):
        radix_topk.select(torch.zeros(2, 10, device="cuda"), 16)
