"""What the loaded-weights finite check costs (model/bridge.py `check_finite_weights`, issue 42).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/bench_finite_check.py [--gib 8] [--out $OUT/finite_check.json]

Weights: `--gib` GiB of bf16 in 8192 × 8192 matrices (128 MiB each, the size of a GLM-5 expert
block) on the GPU when there is one, else on the CPU. Rows, each the best of 3:
  - "ours": `check_finite_weights` (a float32 sum per tensor, one host sync for all of them);
  - "isfinite_all" (the baseline anyone would write): `torch.isfinite(t).all().item()` per tensor,
    which also allocates a bool copy of each tensor and syncs once per tensor.
GiB/s counts the bytes of the weights read once. Prints one RESULT line per row; --out gets all.
"""
import argparse
import json
import time

import torch

from glm5_bridge.model.bridge import check_finite_weights


def _best_of(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def _isfinite_all(chunks) -> bool:
    return all(bool(torch.isfinite(p).all()) for c in chunks for p in c.parameters())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=8.0 if torch.cuda.is_available() else 1.0)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    count = max(1, round(args.gib * 2**30 / (8192 * 8192 * 2)))
    weights = torch.nn.ModuleList(torch.nn.Linear(8192, 8192, bias=False, dtype=torch.bfloat16, device=device)
                                  for _ in range(count))
    size_gib = sum(p.numel() * p.element_size() for p in weights.parameters()) / 2**30
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    rows = []
    for name, fn in (("ours", lambda: check_finite_weights([weights], "bench")),
                     ("isfinite_all", lambda: _isfinite_all([weights]))):
        seconds = _best_of(fn)
        rows.append({"check": name, "device": where, "tensors": count, "gib": round(size_gib, 3),
                     "ms": round(seconds * 1e3, 2), "gib_per_s": round(size_gib / seconds, 1)})
        print("RESULT", json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
