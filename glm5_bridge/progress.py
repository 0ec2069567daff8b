"""Byte progress of a folder being written by code that reports none (megatron-core's
dist_checkpointing.save): a thread sums the sizes of the files under the folder twice a second and
moves a bar towards the expected total. A bar on a terminal; elsewhere (logs, CI) one line at the end.

    with folder_progress(tmp / "weights", total_bytes, "saving weights"):
        dist_checkpointing.save(state, str(tmp / "weights"))
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path


def folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # renamed or removed while we looked
                pass
    return total


@contextmanager
def folder_progress(folder, total: int, desc: str, interval: float = 0.5):
    from tqdm import tqdm

    folder = Path(folder)
    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=None,
               dynamic_ncols=True)
    done = threading.Event()

    def watch() -> None:
        while not done.wait(interval):
            bar.n = min(folder_bytes(folder), total)
            bar.refresh()

    thread = threading.Thread(target=watch, daemon=True)
    start, quiet = time.perf_counter(), bool(bar.disable)  # close() sets disable, so read it first
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        written = folder_bytes(folder)
        bar.n = min(written, total)
        bar.close()
    if quiet:
        seconds = time.perf_counter() - start
        print(f"{desc}: {written / 2**30:.2f} GiB in {seconds:.1f} s", flush=True)
