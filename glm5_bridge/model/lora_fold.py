"""A LoRA folded into the weight it adapts, differentiably: what absorbed MLA needs for kv_b_proj,
whose weight is split into W_UK / W_UV and never called as a layer (model/attention/mla.py).
The PEFT transform that adds the adapters is train/lora.py; this is the model side of it.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.utils import get_pg_size

from glm5_bridge import compat

with compat.megatron_bridge_without_te():  # compat item 1
    from megatron.bridge.peft.lora_layers import LoRALinear
    from megatron.bridge.peft.utils import ParallelLinearAdapter


def gather_rows(weight: torch.Tensor, group) -> torch.Tensor:
    """Concatenate the TP shards of a weight along dim 0; backward sums the grads of every rank
    and hands each rank its own rows (all-gather / reduce-scatter). Identity at TP = 1."""
    if group is None or get_pg_size(group) == 1:
        return weight
    return gather_from_sequence_parallel_region(weight, tensor_parallel_output_grad=True, group=group)


def lora_delta(adapter: ParallelLinearAdapter, base_shape: torch.Size) -> torch.Tensor:
    """(alpha/r)·B·A for the local base shard of shape `base_shape`, differentiable w.r.t. A and B.

    A (linear_in) is gathered when it is split along the rank (column-parallel and duplicated
    bases); B (linear_out) when its rows are fewer than the base's (row-parallel and duplicated
    bases). Column-parallel bases keep their B shard, whose rows are exactly the base shard's.
    """
    a, b = adapter.linear_in.weight, adapter.linear_out.weight
    group = getattr(adapter, "tp_group", None)
    if a.shape[0] != adapter.dim:
        a = gather_rows(a, group)
    if b.shape[0] != base_shape[0]:
        b = gather_rows(b, group)
    delta = (adapter.alpha / adapter.dim) * (b @ a)
    if delta.shape != base_shape:
        raise RuntimeError(f"LoRA delta {tuple(delta.shape)} does not fit its base weight {tuple(base_shape)}")
    return delta


def effective_weight(module: torch.nn.Module) -> torch.Tensor:
    """The weight a linear applies: its own, or base + LoRA delta (differentiable) when it is a
    `LoRALinear` with its adapter enabled. For layers used through their weight, not their forward
    (absorbed MLA's kv_b_proj)."""
    if not isinstance(module, LoRALinear):
        return module.weight
    base = module.to_wrap.weight
    if not module._adapter_enabled:
        return base
    return base + lora_delta(module.adapter, base.shape).to(base.dtype)
