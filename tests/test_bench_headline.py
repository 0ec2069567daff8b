"""benchmarks/bench_dsa.py's headline rows: indexer + our sparse fwd + bwd against the dense bar as
SDPA chooses it, and against every SDPA backend pinned in the same run."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture()
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_dsa", BENCH / "bench_dsa.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_dsa", module)
    spec.loader.exec_module(module)
    module.ROWS.clear()
    module.OUT_PATH = None
    return module


def test_headline_against_chosen_and_pinned_dense(bench):
    bench.emit("indexer", impl="ours", S=8192, ms=1.25)
    bench.emit("sparse_mla", impl="ours", S=8192, H=64, fwd_ms=3.75, bwd_ms=16.0)
    bench.emit("sparse_mla", impl="ours", S=4096, H=64, fwd_ms=1.0, bwd_ms=4.0)  # no indexer row: no headline
    bench.emit("dense_sdpa", S=8192, H=64, backend="auto", picks="cudnn", fwd_bwd_ms=18.0)
    bench.emit("dense_sdpa", S=8192, H=64, backend="flash", fwd_bwd_ms=28.0)
    bench.emit("dense_sdpa", S=8192, H=64, backend="cudnn", fwd_bwd_ms=18.5)
    bench.headline()
    heads = [r for r in bench.ROWS if r["kind"] == "headline"]
    assert len(heads) == 1
    row = heads[0]
    assert (row["S"], row["H"], row["total_ms"]) == (8192, 64, 21.0)
    assert row["dense_fwd_bwd_ms"] == 18.0 and row["dense_picks"] == "cudnn" and row["below_dense"] is False
    assert row["dense_pinned_fwd_bwd_ms"] == {"flash": 28.0, "cudnn": 18.5}
    assert row["below_pinned"] == {"flash": True, "cudnn": False}


def test_targets_from_one_runs_rows(bench):
    """bench_dsa.targets: issue 39's targets from the run's rows, each with its bar and met flag."""
    bench.emit("indexer", impl="ours", S=8192, ms=1.0)
    bench.emit("sparse_mla", impl="ours", S=8192, H=64, fwd_ms=4.0, bwd_ms=14.0, fwd_useful_tflops=630.0,
               fwd_tflops=720.0, bwd_useful_tflops=400.0, bwd_tflops=457.0)
    bench.emit("sparse_mla", impl="iface[ours]", S=8192, H=64, fwd_ms=4.0, bwd_ms=16.0)
    bench.emit("dense_sdpa", S=8192, H=64, backend="auto", picks="cudnn", fwd_bwd_ms=18.0)
    for rank, ms in enumerate([5.0, 6.25]):  # TP 2: tokens split, slowest rank 6.25 → 20 / (2 · 6.25) = 1.6
        bench.emit("tp_attention", tp=2, rank=rank, S=8192, impl="tokens_split", fwd_bwd_ms=ms)
        bench.emit("tp_attention", tp=2, rank=rank, S=8192, impl="heads_split", fwd_bwd_ms=12.5)
    bench.emit("indexer", impl="ours", S=32768, ms=12.0, peak_extra_gib=0.56)
    bench.emit("indexer_check", S=32768, rows_beyond_ties_vs_fp32=0, rows_identical_vs_fp32=0.9999,
               worst_swap_gap_rel=1e-7)
    bench.emit("compile", impl="ours_fwd_bwd", kernel_builds=2, lengths=[1] * 20)
    bench.headline()
    bench.targets()
    got = {r["target"]: r for r in bench.ROWS if r["kind"] == "target"}
    assert got["1_headline_8K"]["value"] == round(19.0 / 18.0, 3) and got["1_headline_8K"]["met"] is False
    assert got["2_fwd_useful_tflops_8K_64h"]["met"] is True and got["2_bwd_useful_tflops_8K_64h"]["met"] is False
    tp = got["3_tp2_per_rank_efficiency_8K"]
    assert tp["faster_layout"] == "tokens_split" and tp["value"] == 1.6 and tp["met"] is True
    assert tp["layouts"]["heads_split"]["efficiency"] == 0.8
    assert got["4_indexer_32K_ms"]["met"] is False and got["4_indexer_32K_extra_gib"]["met"] is True
    assert got["4_indexer_32K_selection_vs_fp32"]["met"] is True
    assert got["5_builds_over_20_lengths"]["met"] is True
    assert "1_headline_16K" not in got  # no 16K rows ran


def test_per_rank_efficiency_prefers_the_one_gpu_row_timed_like_the_ranks(bench):
    """Target 3's one-GPU figure: the tp part's P = 1 row (the whole attention, timed back to back as
    the ranks are) where it ran, not sparse's iface[ours] row; P = 1 itself is no target."""
    bench.emit("sparse_mla", impl="iface[ours]", S=8192, H=64, fwd_ms=4.0, bwd_ms=16.0)
    bench.emit("tp_attention", tp=1, rank=0, S=8192, impl="heads_split", fwd_bwd_ms=22.5)
    bench.emit("tp_attention", tp=1, rank=0, S=8192, impl="tokens_split_in_place", fwd_bwd_ms=22.6)
    for rank, ms in enumerate([5.0, 6.25]):
        bench.emit("tp_attention", tp=2, rank=rank, S=8192, impl="tokens_split_in_place", fwd_bwd_ms=ms)
    bench.targets()
    got = {r["target"]: r for r in bench.ROWS if r["kind"] == "target"}
    assert set(got) == {"3_tp2_per_rank_efficiency_8K"}
    tp = got["3_tp2_per_rank_efficiency_8K"]
    assert tp["value"] == 1.8 and tp["one_gpu_64h_fwd_bwd_ms"] == 22.5  # 22.5 / (2 · 6.25)
    assert tp["one_gpu_from"] == "tp1_heads_split_back_to_back" and tp["sparse_iface_ours_fwd_bwd_ms"] == 20.0


def test_fp32_agreement_tells_ties_from_wrong_picks(bench):
    """bench_dsa.fp32_agreement: the reference's own top-k agrees fully; a row whose pick is swapped
    for a much lower-scored key counts beyond ties; swapping two exactly tied keys does not."""
    import torch

    g = torch.Generator().manual_seed(0)
    s, heads, dim, k, row = 40, 8, 16, 8, 39
    iq, ik, w = torch.randn(s, heads, dim, generator=g), torch.randn(s, dim, generator=g), torch.rand(s, heads, generator=g)
    keys = torch.arange(s)

    def scores():
        sc = torch.einsum("rhd,sd->rhs", iq, ik).relu().mul(w[:, :, None]).sum(1)
        return sc.masked_fill(keys[None] > keys[:, None], float("-inf"))

    order = scores()[row].argsort(descending=True)
    kth, next_ = int(order[k - 1]), int(order[k])
    ik[next_] = ik[kth]  # row 39's k-th and (k+1)-th keys now tie exactly: either is a right pick
    sc = scores()
    best = sc.topk(k, dim=-1)
    ref = best.indices.masked_fill(best.values == float("-inf"), -1)
    assert bench.fp32_agreement(iq, ik, w, ref, rows=16, topk=k)["rows_beyond_ties_vs_fp32"] == 0
    wrong = ref.clone()
    wrong[row, 0] = int(sc[row].argmin())  # a key far below the k-th score
    got = bench.fp32_agreement(iq, ik, w, wrong, rows=16, topk=k)
    assert got["rows_beyond_ties_vs_fp32"] == 1 and got["rows_identical_vs_fp32"] == round((s - 1) / s, 6)
    tied = ref.clone()
    picks = ref[row].tolist()
    slot = picks.index(kth if kth in picks else next_)
    tied[row, slot] = next_ if picks[slot] == kth else kth  # the other of the tied pair
    got = bench.fp32_agreement(iq, ik, w, tied, rows=16, topk=k)
    assert got["rows_beyond_ties_vs_fp32"] == 0 and got["rows_identical_vs_fp32"] == round((s - 1) / s, 6)


def test_rates_count_valid_slots_first(bench):
    """Target 6: each sparse rate both ways, the useful (slots holding a key) first."""
    import torch

    idx = torch.tensor([[0, -1, -1, -1], [1, 0, -1, -1], [2, 1, 0, 3], [3, 2, 1, 0]])  # 1 + 2 + 4 + 4 of 16
    useful = bench.useful_share(idx)
    assert useful == 11 / 16
    got = bench.rates(2e12, 4.0, useful, "bwd_")  # 2 TFLOP over all slots in 4 ms
    assert list(got) == ["bwd_useful_tflops", "bwd_tflops"] and got == {"bwd_useful_tflops": 343.8, "bwd_tflops": 500.0}


def test_ascending_slots_and_rank_rows(bench):
    """bwd_parts' inputs: the same top-k sets in ascending key order with −1 last, and the rows a
    token-parallel rank attends (attention/topk.row_bounds at token_parallel's query cost)."""
    import torch

    from glm5_bridge.model.attention import token_parallel
    from glm5_bridge.model.attention.topk import row_bounds

    idx = torch.tensor([[5, -1, 2, 9], [-1, -1, 0, -1], [3, 1, 2, 0]], dtype=torch.int32)
    assert bench.ascending_slots(idx).tolist() == [[2, 5, 9, -1], [0, -1, -1, -1], [0, 1, 2, 3]]
    ranges = bench.rank_rows(8192, 8)
    assert len(ranges) == 8 and ranges[0][0] == 0 and ranges[-1][1] == 8192
    assert all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))
    cap = bench.TOPK
    bounds = row_bounds((8192,), 8, cap=cap, query_cost=token_parallel.QUERY_COST_KEYS)
    assert [a for a, _ in ranges] == list(bounds[:-1])
    cost = [sum(min(t + 1, cap) + token_parallel.QUERY_COST_KEYS for t in range(a, b)) for a, b in ranges]
    per_query = max(min(t + 1, cap) for t in range(8192)) + token_parallel.QUERY_COST_KEYS
    assert max(cost) - min(cost) <= 2 * per_query  # each range within one query of its share
