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
