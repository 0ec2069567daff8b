"""Trainer checkpoints: the trainable (LoRA) parameters, optimizer and scheduler state, the step,
the loss history and the RNG state — everything a resumed run needs to continue exactly where the
uninterrupted one would be. Each checkpoint is written atomically (temp folder, fsync, rename),
and `latest` is a small file naming the newest complete one (replaced atomically too). A run killed
mid-save leaves a `.step_*.tmp-{pid}` folder that `latest` never names; `remove_abandoned` (called
when a run starts) deletes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from glm5_bridge.files import atomic_output_dir, atomic_write_text, remove_abandoned, torch_load_error  # noqa: F401


def save(folder: Path, step: int, params: dict, optimizer, scheduler, history: list[dict]) -> Path:
    folder = Path(folder)
    target = folder / f"step_{step:07d}"
    with atomic_output_dir(target, overwrite=True) as tmp:
        torch.save({
            "step": step,
            "params": {k: p.detach().clone() for k, p in params.items()},
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": torch.get_rng_state(),
        }, tmp / "state.pt")
        (tmp / "history.json").write_text(json.dumps(history))
    atomic_write_text(folder / "latest", target.name)
    return target


def load_latest(folder: Path) -> tuple[dict, list[dict]] | None:
    """(state, history) of the newest complete checkpoint, or None when there is none."""
    latest = Path(folder) / "latest"
    if not latest.is_file():
        return None
    target = Path(folder) / latest.read_text().strip()
    if not (target / "state.pt").is_file():
        raise FileNotFoundError(f"{latest}: names {target.name}, which has no state.pt")
    try:
        # weights_only: a checkpoint is data; never unpickle arbitrary objects from disk.
        state = torch.load(target / "state.pt", weights_only=True)
    except Exception as e:  # a corrupt or foreign file: one line, not torch's traceback
        raise ValueError(f"{target / 'state.pt'}: not a readable trainer checkpoint ({torch_load_error(e)})") from None
    return state, json.loads((target / "history.json").read_text())



def restore(state: dict, params: dict, optimizer, scheduler) -> int:
    restore_params(state, params)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def restore_params(state: dict, params: dict) -> None:
    missing = set(params) - set(state["params"])
    if missing:
        raise ValueError(f"checkpoint lacks trainable parameter {sorted(missing)[0]} (was the LoRA config changed?)")
    with torch.no_grad():
        for name, p in params.items():
            if p.shape != state["params"][name].shape:
                raise ValueError(f"checkpoint parameter {name} has shape {tuple(state['params'][name].shape)}, "
                                 f"model has {tuple(p.shape)}")
            p.copy_(state["params"][name])
