"""Helpers for the tests: reference models and logits in the layouts the tests compare.
Production code does not import this module."""

from __future__ import annotations

import torch

from glm5_bridge.hf import load_hf  # noqa: F401  (the transformers reference)
from glm5_bridge.parity import megatron_logits  # noqa: F401
from glm5_bridge.tiny import VARIANTS, make_tiny_checkpoint  # noqa: F401
from glm5_bridge.train.data import packed_seq_params


def load_megatron(path, load_weights: bool = True, **provider_overrides):
    """Alias of `glm5_bridge.model.bridge.build_megatron_model` (returns (bridge, model))."""
    from glm5_bridge.model.bridge import build_megatron_model

    return build_megatron_model(path, load_weights, **provider_overrides)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in fp32: the error measure of the kernel and backend tests."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def megatron_packed_logits(model, sequences: list[torch.Tensor]) -> torch.Tensor:
    """Several 1-D id tensors packed into one thd micro-batch → [total, vocab] logits."""
    ids = torch.cat(sequences).unsqueeze(0)
    positions = torch.cat([torch.arange(len(s)) for s in sequences]).unsqueeze(0)
    params = packed_seq_params([len(s) for s in sequences])
    return model(input_ids=ids, position_ids=positions, attention_mask=None, packed_seq_params=params)[0]
