"""What a run reports, written by rank 0 only: one dict per step in `{output_dir}/history.json`
(at least step, loss, grad_norm, lr, tokens_per_s), TensorBoard scalars (tensorboardX, under
`train.tensorboard_dir`, by default `{output_dir}/tensorboard`; "none" turns it off), Weights &
Biases when `train.wandb_project` is set and wandb is installed, a progress bar, and the curves as
a PNG at the end."""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from glm5_bridge.files import atomic_write_text


def is_rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


class RunLog:
    def __init__(self, recipe, history: list[dict], total: int, title: str):
        self.out = Path(recipe.train.output_dir)
        self.history, self.title = history, title
        self.rank0 = is_rank0()
        self.tb = self.wandb = self.bar = None
        if not self.rank0:
            return
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=len(history), desc=title, dynamic_ncols=True,
                        disable=None)  # None: no bar when stderr is not a terminal (logs, CI)
        if self.bar.disable:
            print(f"{title} starts at step {len(history)}/{total}", flush=True)
        tb_dir = recipe.train.tensorboard_dir or str(self.out / "tensorboard")
        if tb_dir != "none":
            try:
                from tensorboardX import SummaryWriter

                self.tb = SummaryWriter(tb_dir)
            except ImportError:
                warnings.warn("tensorboardX is not installed: no TensorBoard logs", stacklevel=2)
        if recipe.train.wandb_project:
            try:
                import wandb

                self.wandb = wandb.init(project=recipe.train.wandb_project, dir=str(self.out), resume="allow",
                                        config={"recipe": recipe.__dict__ if hasattr(recipe, "__dict__") else {}})
            except ImportError:
                warnings.warn("train.wandb_project is set but wandb is not installed", stacklevel=2)

    def log(self, record: dict) -> None:
        self.history.append(record)
        if not self.rank0:
            return
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                if self.tb is not None:
                    self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=step)
        loss, tok_s = f"{record.get('loss', float('nan')):.4f}", f"{record.get('tokens_per_s', 0):.0f}"
        self.bar.update(1)
        self.bar.set_postfix(loss=loss, tok_s=tok_s)
        if self.bar.disable:  # not a terminal: one stdout line per step instead of the bar
            print(f"{self.title} step {step}/{self.bar.total}: loss {loss}, {tok_s} tokens/s", flush=True)

    @contextmanager
    def running(self):
        """The training loop: an error inside ends the progress bar and the writers before it leaves,
        so that the error is the last line a person sees."""
        try:
            yield self
        except BaseException:
            self._end()
            raise

    def _end(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None

    def close(self, curves: list[str], png_name: str) -> str | None:
        """Write history.json and the curves; the PNG's path (rank 0), else None."""
        if not self.rank0:
            return None
        self._end()
        atomic_write_text(self.out / "history.json", json.dumps(self.history, indent=1))
        if not self.history:
            return None
        from glm5_bridge.train.common import plot_curves

        return str(plot_curves(self.history, [c for c in curves if c in self.history[-1]], self.out / png_name,
                               self.title))
