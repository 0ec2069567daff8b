"""Peak GPU memory of a process, for the benchmarks that run the CLI as a child process.

With $GLM5_BRIDGE_STATS naming a file, `record_at_exit()` writes {"peak_gpu_gib": …} there when the
process exits (torch's max_memory_allocated on its GPU; null when it used none). The parent gets
the host side (peak RSS) from the OS (os.wait4), which a process cannot report about itself at exit.
"""

from __future__ import annotations

import atexit
import json
import os

ENV = "GLM5_BRIDGE_STATS"


def record_at_exit() -> None:
    path = os.environ.get(ENV)
    if path:
        atexit.register(_write, path)


def _write(path: str) -> None:
    import torch

    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    with open(path, "w") as f:
        json.dump({"peak_gpu_gib": None if peak is None else round(peak, 2)}, f)
