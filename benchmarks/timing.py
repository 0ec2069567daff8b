"""One timing loop for every benchmark: wall times in ms of `reps` calls after `warmup` calls,
measured with CUDA events on a GPU (each call synchronised) and perf_counter on the CPU; and the
dense bar they compare against."""

import time

import torch


def times_ms(fn, reps: int, warmup: int = 2, device: str = "cuda", inner: int = 1) -> list[float]:
    """`reps` times of one call, ms. inner > 1: each time is the mean of `inner` calls issued back to
    back between one pair of events, so the host's launch work for a call overlaps the GPU's work on
    the one before, as in a model where the CPU runs ahead of the GPU. With inner = 1 the GPU idles
    from the start event until the call's first kernel is launched, and that host time counts: a
    fixed cost per call, more of a 3-ms call (one TP rank's attention) than of a 20-ms one (run BV:
    a TP 8 rank's forward took 0.69–0.80 ms against 0.52 for an eighth of the 64-head forward)."""
    for _ in range(warmup):
        fn()
    if device == "cpu":
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            out.append(1e3 * (time.perf_counter() - t0) / inner)
        return out
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / inner)
    return out


# SDPA's fused backends by the names the benchmarks use: "flash" is FlashAttention-2 inside torch,
# "cudnn" cuDNN's fused attention, "efficient" the memory-efficient kernel; None lets SDPA choose
SDPA_BACKENDS = ("flash", "cudnn", "efficient")


def _sdpa_backends() -> dict:
    """The benchmarks' names → torch's SDPBackend (with "math", which SDPA may pick but is not timed)."""
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def dense_attention(s: int, heads: int, dim: int = 256, device: str = "cuda", backend: str | None = None):
    """The dense bar: causal SDPA over bf16 [1, heads, s, dim] q/k/v → (forward, forward + backward),
    two calls to time. `backend` (one of SDPA_BACKENDS) pins SDPA to that kernel; None: SDPA's choice."""
    import contextlib

    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    q, k, v = (torch.randn(1, heads, s, dim, device=device, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    do = torch.randn(1, heads, s, dim, device=device, dtype=torch.bfloat16)
    pin = (lambda: sdpa_kernel(_sdpa_backends()[backend])) if backend else contextlib.nullcontext

    def fwd():
        with torch.no_grad(), pin():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        with pin():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(do)

    return fwd, fwd_bwd


def sdpa_choice(s: int, heads: int, dim: int = 256, device: str = "cuda") -> str:
    """The fused backend SDPA picks by itself for dense_attention's inputs (its private chooser;
    "unknown" where this torch lacks it)."""
    q = torch.empty(1, heads, s, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    try:
        choice = torch._fused_sdp_choice(q, q, q, is_causal=True)
    except (AttributeError, RuntimeError):
        return "unknown"
    return next((n for n, b in _sdpa_backends().items() if int(b) == int(choice)), str(choice))
