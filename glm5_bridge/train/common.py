"""Pieces shared by the SFT and RL trainers: model + LoRA setup, token log-probs, the optimizer and
learning-rate schedule, the loss-curve plot."""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from glm5_bridge.train.recipe import Recipe


def build_policy(recipe: Recipe, **extra_overrides):
    """(bridge, model chunk with LoRA applied, trainable params) for the recipe's checkpoint."""
    from glm5_bridge.compat import enable_cpu_support
    from glm5_bridge.model.bridge import build_megatron_model

    enable_cpu_support()  # the CPU / no-TE workarounds where they apply (compat.py)
    from glm5_bridge.train.lora import GLM5LoRA, apply_lora, lora_parameters, lora_targets

    m, lo = recipe.model, recipe.lora
    overrides = dict(dsa_attention_backend=m.dsa_attention_backend, mtp_loss_scaling_factor=m.mtp_loss_scaling_factor,
                     tensor_model_parallel_size=m.tensor_model_parallel_size, dsa_token_parallel=m.dsa_token_parallel,
                     sequence_parallel=m.tensor_model_parallel_size > 1,
                     expert_model_parallel_size=m.expert_model_parallel_size)
    if m.bf16:
        overrides.update(bf16=True, params_dtype=torch.bfloat16)
    overrides.update(extra_overrides)
    torch.manual_seed(recipe.train.seed)  # LoRA A init
    bridge, model = build_megatron_model(m.checkpoint, **overrides)
    targets = lora_targets(mla=lo.mla, dense_mlp=lo.dense_mlp, shared_experts=lo.shared_experts, experts=lo.experts)
    model = apply_lora(model, GLM5LoRA(dim=lo.dim, alpha=lo.alpha, dropout=lo.dropout, target_modules=targets))
    return bridge, model, lora_parameters(model)


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


def token_logprobs(model, batch) -> torch.Tensor:
    """log p(label_t | tokens ≤ t) for every position of a packed micro-batch → [T] (fp32).
    Uses megatron's vocab-parallel cross entropy, so it is right at any TP size."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=None,
                   packed_seq_params=batch.packed_seq_params())
    logits = logits.transpose(0, 1).float()  # [b, s, V/TP] → [s, b, V/TP]
    return -vocab_parallel_cross_entropy(logits, batch.labels.transpose(0, 1)).transpose(0, 1)[0]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def optimizer_and_schedule(params: dict, recipe: Recipe):
    t = recipe.train
    optimizer = torch.optim.AdamW(list(params.values()), lr=t.lr, weight_decay=t.weight_decay)

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        floor = t.min_lr / t.lr if t.lr else 0.0
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


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
