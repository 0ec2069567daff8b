"""Megatron vs transformers on the same checkpoint: the numbers behind `glm5-bridge parity`."""

from __future__ import annotations

import torch


def megatron_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] ids → [b, s, vocab] logits (bshd, causal, default positions)."""
    b, s = input_ids.shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, -1)
    return model(input_ids=input_ids, position_ids=position_ids, attention_mask=None)


def logits_parity(checkpoint, seq_len: int = 64, batch: int = 2, seed: int = 0, **provider_overrides) -> float:
    """Max abs difference of fp32 logits on random tokens (bshd, causal)."""
    from glm5_bridge.model.bridge import build_megatron_model
    from glm5_bridge.hf import load_hf

    _, model = build_megatron_model(checkpoint, **provider_overrides)
    hf = load_hf(checkpoint)
    ids = torch.randint(0, hf.config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours = megatron_logits(model.eval(), ids)
        ref = hf(input_ids=ids).logits
    return (ours.float() - ref.float()).abs().max().item()
