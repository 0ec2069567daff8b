"""IndexShare (GLM-5.2 cross-layer DSA): the one place where a layer's top-k is handed to the
layers that reuse it.

The holder lives on an object that exists once per forward of one micro-batch and is passed to
every layer: `packed_seq_params` (thd), else `attention_mask`, else `position_ids`. Keeping it
there (not on the module) keeps micro-batches apart when a pipeline schedule interleaves their
forwards, and lets activation recomputation in backward find the same top-k again.
"""

from __future__ import annotations

import torch

_HOLDER_ATTR = "_glm5_topk_by_layer"


class _PerForwardFallback:
    """Carrier when a forward passes none of the three (bshd, no mask, no position ids)."""


_fallback = _PerForwardFallback()


def _holder(packed_seq_params, attention_mask, position_ids) -> dict[int, torch.Tensor]:
    carrier = next((c for c in (packed_seq_params, attention_mask, position_ids) if c is not None), _fallback)
    holder = getattr(carrier, _HOLDER_ATTR, None)
    if holder is None:
        holder = {}
        setattr(carrier, _HOLDER_ATTR, holder)
    return holder


def publish(layer_number: int, topk: torch.Tensor, packed_seq_params, attention_mask, position_ids) -> None:
    """A computing layer offers its top-k to the shared layers after it."""
    _holder(packed_seq_params, attention_mask, position_ids)[layer_number] = topk


def reuse(layer_number: int, source_layer: int, packed_seq_params, attention_mask, position_ids) -> torch.Tensor:
    """A shared layer takes the top-k of its source layer from this forward."""
    holder = _holder(packed_seq_params, attention_mask, position_ids)
    if source_layer not in holder:
        raise RuntimeError(
            f"IndexShare: layer {layer_number} reuses the top-k of layer {source_layer}, which did not run "
            "earlier in this forward. A pipeline stage must start on a computing ('full') layer.")
    return holder[source_layer]
