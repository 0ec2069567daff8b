"""Trainer checkpoints: a megatron-core distributed checkpoint of everything a resumed run needs —
the LoRA adapters, the optimizer state, the LR scheduler, every rank's RNG state (CPU, CUDA,
megatron's tracker) — plus the step (which is the data position: step s reads global batch s) and
the metric history.

    checkpoints/step_0000010/   dist_checkpointing files, trainer.json (step, layout), history.json
    checkpoints/latest          the name of the newest complete one

Saving is atomic over all ranks (files.atomic_output_dir: one temporary folder every rank writes,
renamed by rank 0 once all have written), then `latest` is replaced atomically. A run killed
mid-save leaves a `.step_*.tmp-{pid}` folder that `latest` never names; `remove_abandoned` deletes it
when a run starts. Loading reshards: a checkpoint saved at one layout (say DP 2) resumes at another
(TP 2); the RNG states are restored only at the layout they were saved at (they only drive dropout,
which GLM-5 LoRA does not use). Every pickle in a checkpoint is read without running code
(files.no_arbitrary_unpickling).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from glm5_bridge.files import (  # noqa: F401  (remove_abandoned: used by the trainers through this module)
    UnsafeCheckpointError,
    atomic_output_dir,
    atomic_write_text,
    no_arbitrary_unpickling,
    remove_abandoned,
)

FORMAT = "glm5-bridge trainer checkpoint v2 (megatron-core dist_checkpointing)"


def _layout() -> dict:
    from megatron.core import parallel_state as ps

    return {"world": torch.distributed.get_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(with_context_parallel=True)}


def identity(recipe) -> dict:
    """What a checkpoint may only be resumed with: the base model (a digest of its config.json and its
    index, or its safetensors headers: cheap, no tensor data), the LoRA shape and the task."""
    import hashlib

    from glm5_bridge.model.source import INDEX_NAME, resolve

    source = resolve(recipe.model.checkpoint)
    digest = hashlib.sha256(json.dumps(source.config, sort_keys=True).encode())
    if source.folder is not None:
        index = source.folder / INDEX_NAME
        files = [index] if index.is_file() else sorted(source.folder.glob("*.safetensors"))
        for file in files:
            with open(file, "rb") as f:
                head = f.read(8)
                digest.update(head + (f.read(int.from_bytes(head, "little")) if file.suffix == ".safetensors" else f.read()))
    lo = recipe.lora
    return {"base": digest.hexdigest()[:16], "task": recipe.task,
            "lora": {"dim": lo.dim, "alpha": lo.alpha, "mla": lo.mla, "dense_mlp": lo.dense_mlp,
                     "shared_experts": lo.shared_experts, "experts": lo.experts}}


def _rng_object(loading: bool):
    """This rank's RNG states as a ShardedObject (one per global rank)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    state = None if loading else {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.empty(0, dtype=torch.uint8),
        "tracker": get_cuda_rng_tracker().get_states() if torch.cuda.is_available() else {},
    }
    return ShardedObject("rng_state", state, (world,), (rank,), replica_id=0)


def _exit_with_parent() -> None:
    """Initializer of the writer's manager process: on Linux the kernel SIGKILLs it when the process
    that started it dies (prctl PR_SET_PDEATHSIG = 1)."""
    import sys

    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def prepare() -> None:
    """Start dist_checkpointing's writer machinery (a multiprocessing manager, about 1.5 s to spawn)
    before training rather than inside the first save, so every save is as short as the later ones:
    a process killed while saving loses that checkpoint.

    megatron-core makes that manager itself (`get_write_results_queue`: a spawned server process that
    nothing stops when its trainer is SIGKILLed — it stayed, with its resource tracker, ~585 MB each,
    until reboot). Ours is the same manager started with `_exit_with_parent`; megatron then finds its
    queue in place and uses it."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:  # what get_write_results_queue() looks at
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(_exit_with_parent)
        filesystem_async._results_queue = manager.Queue()  # the proxy keeps its manager alive


def save(folder: Path, step: int, engine, history: list[dict]) -> Path:
    from megatron.core import dist_checkpointing

    folder = Path(folder)
    target = folder / f"step_{step:07d}"
    state = {**engine.sharded_state(), "rng": _rng_object(loading=False), "step": step}
    with atomic_output_dir(target, overwrite=True) as tmp:
        dist_checkpointing.save(state, str(tmp))
        if torch.distributed.get_rank() == 0:
            (tmp / "trainer.json").write_text(json.dumps({
                "format": FORMAT, "step": step, "layout": _layout(), "identity": identity(engine.recipe),
                "distributed_optimizer": engine.recipe.train.use_distributed_optimizer}))
            (tmp / "history.json").write_text(json.dumps(history))
    if torch.distributed.get_rank() == 0:
        atomic_write_text(folder / "latest", target.name)
    torch.distributed.barrier()
    return target


def latest(folder: Path) -> Path | None:
    """The newest complete checkpoint folder, or None when there is none."""
    pointer = Path(folder) / "latest"
    if not pointer.is_file():
        return None
    target = Path(folder) / pointer.read_text().strip()
    meta = target / "trainer.json"
    if not meta.is_file():
        raise FileNotFoundError(f"{pointer}: names {target.name}, which has no trainer.json")
    try:
        info = json.loads(meta.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{meta}: not valid JSON ({e.msg})") from None
    if info.get("format") != FORMAT:
        raise ValueError(f"{meta}: not a {FORMAT!r} checkpoint (format {info.get('format')!r}); start a new "
                         "train.output_dir or set train.resume=false")
    return target


def load(target: Path, engine) -> tuple[int, list[dict]]:
    """Restore the engine from a checkpoint folder; (step, history)."""
    target = Path(target)
    info = json.loads((target / "trainer.json").read_text())
    saved, now = info.get("identity", {}), identity(engine.recipe)
    for key, what in (("base", "base model"), ("task", "task"), ("lora", "LoRA configuration")):
        if key in saved and saved[key] != now[key]:
            raise ValueError(f"{target}: trained with another {what} ({saved[key]}, this recipe: {now[key]}); "
                             "resume with the run's own recipe, or start a new train.output_dir")
    if info.get("distributed_optimizer") or engine.recipe.train.use_distributed_optimizer:
        # Measured: megatron-core 0.19's distributed-optimizer loader without apex / TE restores the
        # parameters but not every rank's Adam moments (the next update differs), so it is refused.
        raise ValueError(f"{target}: resuming with train.use_distributed_optimizer is not supported (megatron-core "
                         "0.19 restores its Adam state only with apex or Transformer Engine); train with "
                         "use_distributed_optimizer=false to resume, or start a new train.output_dir")
    return _load(target, engine, info["layout"] == _layout())


def _load(target: Path, engine, same_layout: bool) -> tuple[int, list[dict]]:
    from megatron.core import dist_checkpointing

    template = {**engine.sharded_state(loading=True), "step": 0}
    if same_layout:
        template["rng"] = _rng_object(loading=True)
    refused: list[str] = []
    try:
        with no_arbitrary_unpickling(target) as refused:
            loaded = dist_checkpointing.load(template, str(target))
    except BaseException as e:  # torch wraps reader errors in CheckpointException (a BaseException)
        if refused:
            raise UnsafeCheckpointError(refused[0]) from None
        if type(e).__name__ != "CheckpointException" and not isinstance(e, (KeyError, ValueError, RuntimeError)):
            raise
        last = ([line for line in str(e).splitlines() if line.strip()] or [type(e).__name__])[-1].strip()
        raise ValueError(f"{target}: not a readable trainer checkpoint for this run "
                         f"({last[:300] + ' …' if len(last) > 300 else last})") from None
    engine.restore(loaded)
    if same_layout:
        _set_rng(loaded["rng"])
    history = json.loads((target / "history.json").read_text())
    return int(loaded["step"]), history


def _set_rng(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and state["cuda"].numel():
        torch.cuda.set_rng_state(state["cuda"])
        get_cuda_rng_tracker().set_states(state["tracker"])
