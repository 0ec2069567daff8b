"""One timing loop for every benchmark: wall times in ms of `reps` calls after `warmup` calls,
measured with CUDA events on a GPU (each call synchronised) and perf_counter on the CPU; and the
dense bar they compare against."""

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


def dense_attention(s: int, heads: int, dim: int = 256, device: str = "cuda"):
    """The dense bar: causal SDPA over bf16 [1, heads, s, dim] q/k/v → (forward, forward + backward),
    two calls to time."""
    import torch.nn.functional as F

    q, k, v = (torch.randn(1, heads, s, dim, device=device, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    do = torch.randn(1, heads, s, dim, device=device, dtype=torch.bfloat16)

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)

    return fwd, fwd_bwd
