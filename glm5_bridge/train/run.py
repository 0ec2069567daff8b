"""The life of a training run around its steps, the same for the SFT, RL and colocated trainers:
the output folder (rank 0), resume from the latest checkpoint, the steps with a checkpoint every
`train.save_every` and at the end, then history.json, the curves and the export the recipe asks for.

    result = run_steps(recipe, engine, "sft", lambda step: {...one step's record...}, ["loss"], "loss.png")
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from glm5_bridge.train import checkpoint
from glm5_bridge.train.recipe import Recipe
from glm5_bridge.train.runlog import RunLog, is_rank0


def run_steps(recipe: Recipe, engine, title: str, step_fn: Callable[[int], dict], curves: list[str], png: str,
              stop_after: int | None = None) -> dict:
    """`step_fn(step)` runs 0-based step `step` and returns its record (with "step": step + 1).
    `stop_after` ends the run after that many steps of this call (to test resume)."""
    t = recipe.train
    out = Path(t.output_dir)
    if is_rank0():
        out.mkdir(parents=True, exist_ok=True)
        checkpoint.remove_abandoned(out / "checkpoints")  # half-written saves of a killed run
    torch.distributed.barrier()
    if t.save_every:
        checkpoint.prepare()
    start, history = 0, []
    saved = checkpoint.latest(out / "checkpoints") if t.resume else None
    if saved is not None:
        start, history = checkpoint.load(saved, engine)
    else:
        torch.manual_seed(t.seed)
    log = RunLog(recipe, history, t.steps, title)
    end = t.steps if stop_after is None else min(t.steps, start + stop_after)
    with log.running():
        for step in range(start, end):
            log.log(step_fn(step))
            if (t.save_every and (step + 1) % t.save_every == 0) or step + 1 == t.steps:
                checkpoint.save(out / "checkpoints", step + 1, engine, log.history)
    result = {"history": log.history, "output_dir": str(out), "engine": engine, "model": engine.chunk,
              "bridge": engine.bridge}
    curve = log.close(curves, png)
    if curve:
        result["loss_curve"] = curve
    if end == t.steps and recipe.export.kind != "none":
        result["export"] = str(export_trained(recipe, engine))
    return result


@contextmanager
def deterministic_algorithms(on: bool):
    """torch.use_deterministic_algorithms for the run (train.deterministic: bit-exact repeats and
    resumes), restored afterwards."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def export_trained(recipe: Recipe, engine) -> Path:
    from glm5_bridge.train.export import export_adapter, export_merged

    target = Path(recipe.export.dir or Path(recipe.train.output_dir) / f"export_{recipe.export.kind}")
    write = export_merged if recipe.export.kind == "merged" else export_adapter
    return write(engine.bridge, engine.chunk, target, overwrite=True)
