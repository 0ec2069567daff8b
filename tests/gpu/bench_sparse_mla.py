"""Times the DSA attention backends at GLM-5 dims (64 heads, q/kv 576, v 512, top-k 2048), bf16,
thd. Run by scripts/gpu_tests.sh after the tests; prints a table last.

Medians of CUDA-event times after 2 warm-ups; backward = (forward + backward) − forward. TFLOP/s
are nominal, over all top-k slots (the kernels process −1 slots too): fwd 2·T·H·K·(576+512),
bwd 2·T·H·K·(3·576+2·512); `valid` is the share of slots that hold a key.
"""

import json
import os
import statistics

import torch

import glm5_bridge

glm5_bridge.register()

glm5_bridge.enable_cpu_support()
from benchmarks.timing import times_ms
from glm5_bridge.model.attention.backends import get_backend
from glm5_bridge.kernels import D_QK, D_V
from glm5_bridge.kernels.reference import random_causal_topk

HEADS, TOPK, SCALE = 64, 2048, 1 / 16


def median_ms(fn, reps):
    t = times_ms(fn, reps)
    return statistics.median(t), min(t), max(t)


def case(lengths, backends):
    total = sum(lengths)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(total, HEADS, D_QK, device="cuda", generator=g).bfloat16().requires_grad_()
    kv = torch.randn(total, D_QK, device="cuda", generator=g).bfloat16().requires_grad_()
    topk = random_causal_topk(lengths, TOPK, device="cuda", generator=g)
    dout = torch.randn(total, HEADS, D_V, device="cuda", generator=g).bfloat16()
    valid = (topk >= 0).float().mean().item()
    fwd_flop = 2 * total * HEADS * TOPK * (D_QK + D_V)
    bwd_flop = 2 * total * HEADS * TOPK * (3 * D_QK + 2 * D_V)
    rows = []
    for name in backends:
        fn = get_backend(name)

        def fwd():
            with torch.no_grad():
                fn(q, kv, topk, SCALE, D_V, packed=True)

        def fwd_bwd():
            q.grad = kv.grad = None
            fn(q, kv, topk, SCALE, D_V, packed=True).backward(dout)

        reps = 20 if name == "tilelang" else 3
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        try:
            t_f, f_lo, f_hi = median_ms(fwd, reps)
            t_fb, fb_lo, fb_hi = median_ms(fwd_bwd, reps)
        except torch.OutOfMemoryError:
            print(f"{name} T={total}: out of memory", flush=True)
            continue
        row = dict(backend=name, tokens=total, lengths="+".join(map(str, lengths)), valid=round(valid, 3),
                   fwd_ms=round(t_f, 3), fwd_spread_ms=round(f_hi - f_lo, 3), fwd_bwd_ms=round(t_fb, 3),
                   fwd_bwd_spread_ms=round(fb_hi - fb_lo, 3), bwd_ms=round(t_fb - t_f, 3),
                   fwd_tflops=round(fwd_flop / t_f / 1e9, 1), bwd_tflops=round(bwd_flop / (t_fb - t_f) / 1e9, 1),
                   peak_extra_gib=round((torch.cuda.max_memory_allocated() - base) / 2**30, 2))
        print("RESULT bench " + json.dumps(row), flush=True)
        if os.environ.get("GLM5_GPU_RESULTS"):
            with open(os.environ["GLM5_GPU_RESULTS"], "a") as f:
                f.write(json.dumps({"name": "bench", **row}) + "\n")
        rows.append(row)
    return rows


def main():
    rows = []
    rows += case([4096, 2500, 1700], ["tilelang", "megatron"])
    rows += case([4096, 2500, 1700], ["tilelang"])  # same version again: the run-to-run spread
    rows += case([32768], ["tilelang"])
    cols = ["backend", "tokens", "valid", "fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_tflops", "bwd_tflops",
            "peak_extra_gib"]
    print("\n" + " | ".join(cols))
    for row in rows:
        print(" | ".join(str(row[c]) for c in cols))


if __name__ == "__main__":
    main()
