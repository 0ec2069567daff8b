"""benchmarks/bench_tp.py's CPU smoke run (tiny dims, torch indexer, unfused attention, one process
playing each TP rank in a fake process group): every rank reports its attention per layout and per
query cost, and the summaries pick each (S, P, cost)'s slowest rank from those rows."""

import json
import subprocess
import sys
from pathlib import Path

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
