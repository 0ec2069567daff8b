"""One timing loop for every benchmark: wall times in ms of `reps` calls after `warmup` calls,
measured with CUDA events on a GPU (each call synchronised) and perf_counter on the CPU."""

import time

import torch


def times_ms(fn, reps: int, warmup: int = 2, device: str = "cuda") -> list[float]:
    for _ in range(warmup):
        fn()
    if device == "cpu":
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append(1e3 * (time.perf_counter() - t0))
        return out
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out
