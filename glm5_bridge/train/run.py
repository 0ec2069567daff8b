"""The life of a training run around its steps, the same for the SFT, RL and colocated trainers:
the output folder (rank 0, locked for the run: a second training into it is refused), resume from
the latest checkpoint (refused when it was trained from another base model, LoRA shape or task), the
recipe written beside it, the steps — a step whose loss or gradient norm is not finite stops the run
before anything of it is saved — with a checkpoint every `train.save_every` and at the end, then
history.json, the curves and the export the recipe asks for.

    result = run_steps(recipe, engine, "sft", lambda step: {...one step's record...}, ["loss"], "loss.png")
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from glm5_bridge.files import OutputRefused, check_output, mark_output
from glm5_bridge.train import checkpoint
from glm5_bridge.train.recipe import Recipe
from glm5_bridge.train.runlog import RunLog, is_rank0


def run_steps(recipe: Recipe, engine, title: str, step_fn: Callable[[int], dict], curves: list[str], png: str,
              stop_after: int | None = None) -> dict:
    """`step_fn(step)` runs 0-based step `step` and returns its record (with "step": step + 1).
    `stop_after` ends the run after that many steps of this call (to test resume)."""
    t = recipe.train
    out = Path(t.output_dir)
    lock = _locked_run_folder(out)
    try:
        if t.save_every:
            checkpoint.prepare()
        start, history = 0, []
        saved = checkpoint.latest(out / "checkpoints") if t.resume else None
        if saved is not None:
            start, history = checkpoint.load(saved, engine)
        else:
            torch.manual_seed(t.seed)
        if is_rank0():  # what `glm5-bridge export RUN` rebuilds from; only once the run is known to start
            from glm5_bridge.files import atomic_write_text
            from glm5_bridge.train.recipe import to_yaml

            atomic_write_text(out / "recipe.yaml", to_yaml(recipe))
        log = RunLog(recipe, history, t.steps, title)
        end = t.steps if stop_after is None else min(t.steps, start + stop_after)
        with log.running():
            for step in range(start, end):
                record = step_fn(step)
                _check_finite(record)
                log.log(record)
                if (t.save_every and (step + 1) % t.save_every == 0) or step + 1 == t.steps:
                    checkpoint.save(out / "checkpoints", step + 1, engine, log.history)
    finally:
        if lock is not None:
            lock.close()
    result = {"history": log.history, "output_dir": str(out), "engine": engine, "model": engine.chunk,
              "bridge": engine.bridge}
    curve = log.close(curves, png)
    if curve:
        result["loss_curve"] = curve
    if end == t.steps and recipe.export.kind != "none":
        result["export"] = str(export_trained(recipe, engine, log.history))
    return result


def _locked_run_folder(out: Path):
    """Rank 0 makes the folder, removes what killed saves left, and takes an exclusive lock on
    `.lock` for the run (released when the process ends, however it ends); every rank learns
    whether it got it. Returns the open lock file (rank 0) or None."""
    import fcntl
    import os

    handle, problem = None, None
    if is_rank0():
        try:
            out.mkdir(parents=True, exist_ok=True)
            handle = open(out / ".lock", "a+")
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            handle.seek(0)
            handle.truncate()
            handle.write(f"{os.getpid()}\n")
            handle.flush()
            mark_output(out, "run")  # a later run (a resume) may write into it; --overwrite never replaces it
            checkpoint.remove_abandoned(out / "checkpoints")  # half-written saves of a killed run
        except BlockingIOError:
            handle.seek(0)
            problem = f"{out}: another training is running in this folder (pid {handle.read().strip() or '?'})"
            handle.close()
            handle = None
        except OSError as e:
            problem = f"{out}: {e.strerror or e}"
    box = [problem]
    torch.distributed.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise ValueError(box[0])
    return handle


def warn_topk_beyond_sequences(hf, longest: int, what: str) -> None:
    """The sparse attention pays for `index_topk` key slots per query however short the sequence:
    say so when no sequence of the run is that long (a config typo costs 50× a step, silently)."""
    import warnings

    topk = hf.index_topk
    if topk > longest:
        warnings.warn(f"config.json: index_topk={topk} exceeds the longest {what} ({longest} tokens): every query "
                      f"attends to all its keys and still pays for {topk} slots (the published GLM-5.x use 2048)",
                      stacklevel=2)


def _check_finite(record: dict) -> None:
    import math

    for key in ("loss", "grad_norm"):
        value = record.get(key)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"step {record['step']}: {key} is {value}; stopped before saving anything of this "
                             "step (non-finite base weights, data or learning rate?)")


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


def export_target(recipe: Recipe) -> Path:
    return Path(recipe.export.dir or Path(recipe.train.output_dir) / f"export_{recipe.export.kind}")


def check_run_outputs(recipe: Recipe) -> None:
    """Before any work (files.check_output): the run folder and the export folder may not be, contain
    or lie inside the base checkpoint; the export folder may not be or contain the run folder, nor
    lie inside its checkpoints; either, when it exists and is not empty, must be one this project
    wrote (the run folder is written into; the export folder is replaced when training ends)."""
    run, base = Path(recipe.train.output_dir), recipe.model.checkpoint
    check_output(run, [base], overwrite=True, kind="run")
    if recipe.export.kind == "none":
        return
    target = export_target(recipe)
    if target.resolve() == run.resolve() or target.resolve() in run.resolve().parents:
        raise OutputRefused(f"export.dir {target}: {'is' if target.resolve() == run.resolve() else 'contains'} "
                            f"the run folder {run}; choose another export folder")
    check_output(target, [base, run / "checkpoints"], overwrite=True)


def export_trained(recipe: Recipe, engine, history: list[dict]) -> Path:
    from glm5_bridge.train.export import export_adapter, export_merged

    write = export_merged if recipe.export.kind == "merged" else export_adapter
    return write(engine.bridge, engine.chunk, export_target(recipe), overwrite=True,
                 reads=[Path(recipe.train.output_dir) / "checkpoints"], recipe=recipe, history=history)
