"""Fit token-parallel attention's per-query cost (token_parallel.QUERY_COST_KEYS) to measured ranks.

Reads bench_tp.py's per-rank attention rows (its --out file, a results file holding several runs'
row lists under run ids, or bench_dsa.py's output with its tp part's rows) and fits, per layout (`impl`), a rank's fwd + bwd time as

    ms = a · rows + b · keys + offset[run]        keys = Σ over its rows of min(p + 1, top-k)

by least squares, each run with its own offset (machine and launch overheads differ run to run).
A query's fixed cost in keys' worth is a / b: the QUERY_COST_KEYS that row_bounds should use. Its
spread comes from a bootstrap over the rows. The rows' ranges are recomputed with row_bounds at each
row's recorded query_cost (one causal sequence of S tokens), so the fit needs no other input.

    python3 benchmarks/fit_query_cost.py benchmarks/results/h100_2026-12-07_runBU_BX_BY_tp_head_blocks_query_costs.json \
        benchmarks/results/h100_2026-12-07_runBV_bench_dsa_targets.json
"""

import argparse
import json
import os
import sys
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if "glm5_bridge" not in sys.modules:  # row_bounds without the model stack
    pkg = types.ModuleType("glm5_bridge")
    pkg.__path__ = [str(ROOT / "glm5_bridge")]
    sys.modules["glm5_bridge"] = pkg

from glm5_bridge.model.attention.topk import row_bounds  # noqa: E402

TOPK = 2048


def runs_of(data) -> dict[str, list[dict]]:
    """{run id: rows}: a bench_tp --out list is one run ("run"); a dict maps run ids to row lists
    (other keys, not lists of rows, are skipped)."""
    if isinstance(data, list):
        return {"run": data}
    return {k: v for k, v in data.items() if isinstance(v, list) and v and isinstance(v[0], dict) and "kind" in v[0]}


def features(row: dict, topk: int = TOPK) -> tuple[int, int]:
    """(rows, keys) of the rank that measured `row`: its row_bounds range at the row's query cost."""
    bounds = row_bounds((row["S"],), row["tp"], cap=topk, query_cost=row["query_cost"])
    p = np.arange(bounds[row["rank"]], bounds[row["rank"] + 1])
    return len(p), int(np.minimum(p + 1, topk).sum())


def fit(points: list[tuple[str, int, int, float]], boot: int = 2000, seed: int = 0) -> dict:
    """points: (run, rows, keys, ms) → the coefficients, the query cost a / b in keys, its bootstrap
    median and 90 % interval, and the fit's rms error (ms)."""
    runs = sorted({r for r, *_ in points})
    x = np.array([[rows / 1e3, keys / 1e6] + [float(r == run) for run in runs] for r, rows, keys, _ in points])
    y = np.array([ms for *_, ms in points])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    rng = np.random.default_rng(seed)
    costs = []
    for _ in range(boot):
        pick = rng.integers(0, len(y), len(y))
        c, *_ = np.linalg.lstsq(x[pick], y[pick], rcond=None)
        costs.append(c[0] / c[1] * 1e3)
    lo, mid, hi = np.percentile(costs, [5, 50, 95])
    return dict(points=len(y), runs=runs, us_per_row=round(coef[0], 4), ns_per_key=round(coef[1], 4),
                offsets_ms=dict(zip(runs, np.round(coef[2:], 3).tolist())),
                query_cost_keys=round(coef[0] / coef[1] * 1e3, 1), bootstrap_median=round(mid, 1),
                bootstrap_90=[round(lo, 1), round(hi, 1)], rms_ms=round(float(np.sqrt(np.mean((x @ coef - y) ** 2))), 4))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+", help="bench_tp --out files or results files with runs' rows")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "fit_query_cost.json"))
    a = ap.parse_args()
    by_impl = {}
    for path in a.files:
        for run, rows in runs_of(json.loads(Path(path).read_text())).items():
            for row in rows:
                attention = row.get("part") == "attention" or row.get("kind") == "tp_attention"  # bench_dsa's tp part
                if attention and row.get("impl", "").startswith("tokens_split"):
                    n, keys = features(row)
                    by_impl.setdefault(row["impl"], []).append((f"{Path(path).stem}:{run}", n, keys, row["fwd_bwd_ms"]))
    results = []
    for impl, points in sorted(by_impl.items()):
        result = dict(kind="query_cost_fit", impl=impl, **fit(points))
        results.append(result)
        print("RESULT " + json.dumps(result), flush=True)
    Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
