"""benchmarks/bench_tp.py's CPU smoke run (tiny dims, torch indexer, unfused attention, one process
playing each TP rank in a fake process group): every rank reports its attention per layout and per
query cost, and the summaries pick each (S, P, cost)'s slowest rank from those rows. And
benchmarks/fit_query_cost.py recovers a known per-query cost from rows made with it."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

import glm5_bridge  # noqa: F401  (the real package: fit_query_cost.py's stand-in for it stays out of sys.modules)

ROOT = Path(__file__).resolve().parents[1]


def test_emulated_ranks_and_query_cost_summary(tmp_path):
    out = tmp_path / "bench_tp.json"
    proc = subprocess.run([sys.executable, "bench_tp.py", "--emulate", "2", "--seqs", "64", "--reps", "1",
                           "--parts", "indexer,attention,dense", "--query-costs", "0,100", "--out", str(out)],
                          cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    attention = [r for r in rows if r["kind"] == "bench_tp_emulated" and r["part"] == "attention"]
    # heads split is the same work on every rank: rank 0 only; tokens split on both (no GPU: no in-place variant)
    assert sorted((r["impl"], r["rank"]) for r in attention) == [("heads_split", 0), ("tokens_split", 0),
                                                                 ("tokens_split", 1)]
    swept = [r for r in rows if r["kind"] == "bench_tp_query_cost" and r["part"] == "attention"]
    assert sorted((r["query_cost"], r["rank"]) for r in swept) == [(0, 0), (0, 1), (100, 0), (100, 1)]
    for cost in (0, 100):
        summary = [r for r in rows if r["kind"] == "query_cost" and r["query_cost"] == cost]
        times = {r["rank"]: r["fwd_bwd_ms"] for r in swept if r["query_cost"] == cost}
        assert len(summary) == 1 and summary[0]["ranks"] == 2
        assert summary[0]["slowest_fwd_bwd_ms"] == max(times.values()) == times[summary[0]["slowest_rank"]]
    per_rank = [r for r in rows if r["kind"] == "per_rank"]
    tokens = max(r["fwd_bwd_ms"] for r in attention if r["impl"] == "tokens_split")
    assert len(per_rank) == 1 and per_rank[0]["tokens_split_ms"] == tokens


def test_fit_recovers_a_known_query_cost(tmp_path):
    """Rows as bench_tp writes them, timed by a known model (0.25 µs a query, 1.2 ns a selected key,
    a different offset per run, ±20 µs noise) over the ranges row_bounds gives at several query
    costs: the fit's query cost is 0.25 / 1.2e-3 ≈ 208 keys."""
    spec = importlib.util.spec_from_file_location("fit_query_cost", ROOT / "benchmarks" / "fit_query_cost.py")
    fit_query_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit_query_cost)
    noise = np.random.default_rng(1)
    runs = {}
    for run, offset in (("A", 0.6), ("B", 0.7)):
        rows = []
        for tp in (4, 8):
            for cost in (0, 200, 400):
                for rank in range(tp):
                    row = dict(kind="bench_tp_emulated", part="attention", impl="tokens_split_in_place", S=8192,
                               tp=tp, rank=rank, query_cost=cost)
                    n, keys = fit_query_cost.features(row)
                    row["fwd_bwd_ms"] = 0.25e-3 * n + 1.2e-6 * keys + offset + noise.normal(0, 0.02)
                    rows.append(row)
        runs[run] = rows
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"about": "synthetic", **runs}))
    out = tmp_path / "fit.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fit_query_cost.py"), str(path), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (result,) = json.loads(out.read_text())
    assert result["points"] == 2 * 3 * (4 + 8) and result["runs"] == ["runs:A", "runs:B"]
    assert abs(result["query_cost_keys"] - 208.3) <= 10 and result["bootstrap_90"][0] < 208.3 < result["bootstrap_90"][1]
    assert abs(result["offsets_ms"]["runs:B"] - result["offsets_ms"]["runs:A"] - 0.1) <= 0.03


def test_back_to_back_times_are_the_mean_of_the_inner_calls(monkeypatch):
    """timing.times_ms(inner=n): n calls per repetition between one pair of clock reads, reported per
    call (bench_tp's attention rows: BACK_TO_BACK); a fake clock advancing 1 s per call gives 1000 ms."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import timing

    clock, calls = [0.0], []
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])

    def call():
        calls.append(1)
        clock[0] += 1.0

    assert timing.times_ms(call, reps=3, warmup=2, device="cpu", inner=4) == [1000.0] * 3
    assert len(calls) == 2 + 3 * 4
