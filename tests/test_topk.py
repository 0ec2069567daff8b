"""Top-k selection and the unfused sparse MLA, checked against dense brute force."""

import torch

from glm5_bridge.model.attention.topk import check_topk, flat_starts_bshd, flat_starts_thd, index_scores, select_topk
from glm5_bridge.model.attention.unfused import sparse_mla


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_short_sequences_are_padded_not_refused():
    starts = flat_starts_thd(torch.tensor([0, 3, 5]), 5)
    q, k, w = _rand(5, 4, 8), _rand(5, 8, seed=1), _rand(5, 4, seed=2)
    topk = select_topk(q, k, w, starts, topk=6)
    assert topk.shape == (5, 6)
    # Query t of a sequence starting at s0 sees exactly t - s0 + 1 keys, the rest is -1.
    visible = [1, 2, 3, 1, 2]
    for t, n in enumerate(visible):
        assert sorted(topk[t, :n].tolist()) == list(range(int(starts[t]), t + 1))
        assert (topk[t, n:] == -1).all()


def test_topk_picks_the_highest_visible_scores():
    total, topk = 40, 8
    starts = flat_starts_bshd(20, 2, "cpu")
    q, k, w = _rand(total, 4, 8), _rand(total, 8, seed=1), _rand(total, 4, seed=2)
    got = select_topk(q, k, w, starts, topk)
    scores = index_scores(q, k, w)
    for t in range(total):
        window = list(range(int(starts[t]), t + 1))
        expect = sorted(window, key=lambda s: -scores[t, s].item())[:topk]
        assert sorted(x for x in got[t].tolist() if x >= 0) == sorted(expect)
    check_topk(got, starts)  # computed top-k is always inside the causal window


def test_check_topk_names_the_bad_row():
    starts = flat_starts_bshd(4, 1, "cpu")
    topk = torch.tensor([[0, -1], [0, 1], [3, 2], [1, 0]])
    try:
        check_topk(topk, starts)
    except ValueError as e:
        assert "row 2 selects key 3" in str(e)
    else:
        raise AssertionError("future key not rejected")


def test_sparse_mla_equals_dense_masked_attention():
    total, heads, dim, v_dim, k = 24, 3, 12, 8, 5
    starts = flat_starts_thd(torch.tensor([0, 10, 24]), total)
    q, kv = _rand(total, heads, dim), _rand(total, dim, seed=1)
    topk = select_topk(_rand(total, 2, 4, seed=3), _rand(total, 4, seed=4), _rand(total, 2, seed=5), starts, k)
    out = sparse_mla(q, kv, topk, softmax_scale=0.3, v_dim=v_dim)
    mask = torch.zeros(total, total, dtype=torch.bool)
    for t in range(total):
        mask[t, topk[t][topk[t] >= 0]] = True
    logits = torch.einsum("thd,sd->ths", q, kv) * 0.3
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    ref = torch.einsum("ths,sc->thc", logits.softmax(-1), kv[:, :v_dim])
    assert (out - ref).abs().max().item() < 1e-12


def test_sparse_mla_empty_rows_give_zeros_and_finite_grads():
    q = _rand(3, 2, 6).requires_grad_()
    kv = _rand(3, 6, seed=1).requires_grad_()
    topk = torch.tensor([[0, -1], [-1, -1], [1, 2]])
    out = sparse_mla(q, kv, topk, 1.0, 4)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()


def test_row_range_gives_those_rows_of_the_full_selection():
    """select_topk(rows=(a, b)) — what each tensor-parallel rank runs for its share of the rows —
    returns rows a … b−1 of the full selection, across score-chunk boundaries and packed starts."""
    from glm5_bridge.model.attention import topk as topk_mod

    starts = flat_starts_thd(torch.tensor([0, 7, 30, 31, 45]), 45)
    q, k, w = _rand(45, 4, 8), _rand(45, 8, seed=1), _rand(45, 4, seed=2)
    full = select_topk(q, k, w, starts, 6)
    chunk, topk_mod.SCORE_ROW_CHUNK = topk_mod.SCORE_ROW_CHUNK, 4  # several chunks per range
    try:
        for a, b in [(0, 45), (5, 6), (6, 31), (29, 45), (44, 45), (10, 10)]:
            assert torch.equal(select_topk(q, k, w, starts, 6, rows=(a, b)), full[a:b]), (a, b)
    finally:
        topk_mod.SCORE_ROW_CHUNK = chunk


def _split_starts(total):  # three packed sequences (fewer when total is tiny)
    return flat_starts_thd(torch.tensor(sorted({0, min(5, total), total // 2, total})), total)


def _split_topk(rank, world_size, total, topk):
    from glm5_bridge.model.attention.topk import select_topk_split

    starts = _split_starts(total)
    q, k, w = _rand(total, 4, 8), _rand(total, 8, seed=1), _rand(total, 4, seed=2)
    calls = []

    def counting(*args, rows=None):  # the rows this rank scores
        calls.append(rows)
        return select_topk(*args, rows=rows)

    got = select_topk_split(counting, q, k, w, starts, topk, torch.distributed.group.WORLD)
    return got, calls


def test_tensor_parallel_ranks_split_the_indexer_rows():
    """Under TP every rank holds the same indexer q/k/weights; select_topk_split has each score
    two of 2·P row chunks (r and 2P−1−r: equal causal work) and all-gathers the rest. Every rank
    must end with the unsplit selection, having scored only its own rows; also when the token
    count does not fill the chunks or is smaller than 2P."""
    from glm5_bridge.distributed import run_local_ranks

    for world, total in [(3, 45), (2, 3)]:
        want = select_topk(_rand(total, 4, 8), _rand(total, 8, seed=1), _rand(total, 4, seed=2), _split_starts(total), 6)
        results = run_local_ranks(_split_topk, world, total, 6)
        chunk = -(-total // (2 * world))
        for rank, (got, calls) in enumerate(results):
            assert torch.equal(got, want), (world, total, rank)
            expect = [(min(c * chunk, total), min((c + 1) * chunk, total)) for c in (rank, 2 * world - 1 - rank)]
            assert calls == [r for r in expect if r[1] > r[0]], (world, total, rank, calls)


def test_row_bounds_balance_the_cost():
    """row_bounds against the cost summed query by query: P contiguous ranges covering the rows
    in order, each within one query's cost of 1/P of the total (a query at position p costs p + 1,
    or min(p + 1, cap), plus query_cost), for one long sequence, packed ones, and fewer rows than ranks."""
    from glm5_bridge.model.attention.topk import row_bounds

    for lengths in [(8192,), (1000, 3000, 5, 4187), (2,), (7, 0, 9)]:
        for parts in (2, 3, 8):
            for cap, query_cost in ((None, 0), (2048, 0), (4, 0), (2048, 290), (4, 3)):
                cost = [min(p + 1, cap or p + 1) + query_cost for n in lengths for p in range(n)]
                bounds = row_bounds(lengths, parts, cap, query_cost)
                assert bounds[0] == 0 and bounds[-1] == len(cost) and list(bounds) == sorted(bounds)
                share = sum(cost) / parts
                for a, b in zip(bounds, bounds[1:]):
                    assert abs(sum(cost[a:b]) - share) <= max(cost), (lengths, parts, cap, bounds)
    # one 8K sequence, top-k 2048, TP 2: the capped cost moves the boundary past the middle
    assert row_bounds((8192,), 2, 2048) == (0, 4608, 8192)
    # TP 8 with the fixed cost per query: rank 0 (the short early queries) gets fewer rows than the
    # 1916 it got without, ranks 2–7 more than 896 (ranks 1–7 of 8: 900, 896, …; with: 926, 912, …)
    without, with_cost = row_bounds((8192,), 8, 2048), row_bounds((8192,), 8, 2048, 290)
    assert without[1] == 1916 and {b - a for a, b in zip(without[2:], without[3:])} == {896}
    assert 1780 <= with_cost[1] <= 1810 and all(905 <= b - a <= 930 for a, b in zip(with_cost[1:], with_cost[2:]))


def test_a_row_range_takes_just_its_own_query_rows():
    """rows=(a, b) with q / weights holding only queries a … b−1 (context parallel's local rows, no
    T-row buffer) gives exactly the T-row layout's top-k, in the torch selection and in
    kernels/indexer.select_topk's blocking (reference score kernel on the CPU)."""
    from glm5_bridge.kernels import indexer

    starts = flat_starts_thd(torch.tensor([0, 7, 30, 45]), 45)
    q, k, w = _rand(45, 4, 8), _rand(45, 8, seed=1), _rand(45, 4, seed=2)
    kernel = indexer.reference_logits_kernel(4, 8)
    for a, b in [(5, 6), (6, 31), (29, 45)]:
        assert torch.equal(select_topk(q[a:b], k, w[a:b], starts, 6, rows=(a, b)),
                           select_topk(q, k, w, starts, 6, rows=(a, b))), (a, b)
        ours = indexer.select_topk(q[a:b].contiguous(), k, w[a:b], starts, 6, rows=(a, b), row_block=8, kernel=kernel)
        assert torch.equal(ours, indexer.select_topk(q, k, w, starts, 6, rows=(a, b), row_block=8, kernel=kernel))
