"""Pieces shared by the SFT and RL trainers: token log-probs from logits, adapters off (the RL
reference policy), the loss-curve plot. The model, optimizer and schedule: train/engine.py."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch



@contextmanager
def adapters_off(model):
    """The base model (the RL reference policy): every LoRA adapter disabled inside the block."""
    wrappers = [m for m in model.modules() if hasattr(m, "disable_adapter_layers")]
    for m in wrappers:
        m.disable_adapter_layers()
    try:
        yield model
    finally:
        for m in wrappers:
            m.enable_adapter_layers()


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """−log p(label_t | tokens ≤ t) for every position of a packed micro-batch → [T] (fp32), from
    the model's [1, T, V/TP] logits. megatron's vocab-parallel cross entropy: right at any TP size."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = logits.transpose(0, 1).float()  # [b, s, V/TP] → [s, b, V/TP]
    return vocab_parallel_cross_entropy(logits, labels.transpose(0, 1)).transpose(0, 1)[0]


def token_logprobs(model, batch) -> torch.Tensor:
    """log p(label_t | tokens ≤ t) for every position of a packed micro-batch → [T] (fp32)."""
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=None,
                   packed_seq_params=batch.packed_seq_params(batch.input_ids.device))
    return -token_nll(logits, batch.labels)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def plot_curves(history: list[dict], keys: list[str], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.2), squeeze=False)
    steps = [h["step"] for h in history]
    for ax, key in zip(axes[0], keys):
        ax.plot(steps, [h[key] for h in history], marker="o", markersize=2)
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"  # atomic: a reader never sees half a PNG
    try:
        fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".") or "png")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        plt.close(fig)
    return path
