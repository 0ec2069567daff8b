"""benchmarks/bench_cp.py's CPU smoke run (tiny dims, unfused backend, one process playing each CP
rank in a fake process group): every rank's top-k equals CP 1's rows and its attention output
matches them, and each rank reports its parts' times and wire bytes."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_emulated_rank_matches_cp1(tmp_path):
    out = tmp_path / "bench_cp.json"
    proc = subprocess.run([sys.executable, "bench_cp.py", "--seqs", "64", "--cp", "1,2,4", "--reps", "1",
                           "--out", str(out)], cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    ranks = [r for r in rows if r.get("cp", 1) > 1 and "rank" in r]
    assert sorted((r["cp"], r["rank"]) for r in ranks) == [(2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]
    assert all(r["same_topk"] and r["out_vs_cp1_rel"] <= 1e-6 for r in ranks)
    assert all(r["queries"] == 64 // r["cp"] and r["wire_bytes"] == (r["cp"] - 1) * r["queries"] * (2 * 40 + 16) * 4
               for r in ranks)
    assert [r["cp"] for r in rows if r.get("kind") == "summary"] == [2, 4]
