"""Run a function in N local processes with a gloo process group: multi-rank tests on one CPU
machine (TP=2 and friends). The function gets (rank, world_size, *args); its return values come
back in rank order, and an exception on any rank fails the whole run with that rank's traceback."""

from __future__ import annotations

import os
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch

    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results[rank] = ("ok", fn(rank, world_size, *args))
    except BaseException:  # report every failure, including assertion errors
        results[rank] = ("error", traceback.format_exc())
    finally:
        torch.distributed.destroy_process_group()


def run_local_ranks(fn, world_size: int, *args):
    """fn must be importable (module-level) so the spawned processes can find it."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_worker, args=(world_size, free_port(), fn, args, results), nprocs=world_size,
                           join=True, start_method="spawn")
        out = dict(results)
    for rank in range(world_size):
        status, value = out.get(rank, ("error", "no result"))
        if status != "ok":
            raise RuntimeError(f"rank {rank} failed:\n{value}")
    return [out[r][1] for r in range(world_size)]
