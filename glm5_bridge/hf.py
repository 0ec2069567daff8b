"""transformers' side of GLM-5: the reference model, and the routed experts' two layouts.

transformers keeps a MoE layer's routed experts fused in memory — `mlp.experts.gate_up_proj`
[E, 2I, H] and `mlp.experts.down_proj` [E, H, I] — while checkpoints (and megatron-bridge's mapping)
keep them one by one: `mlp.experts.{e}.gate_proj / up_proj / down_proj.weight`. `unfuse` goes from
the first to the second (for tensors, or for shapes alone), `fuse` back.
"""

from __future__ import annotations

import os

import torch

GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def load_hf(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """transformers' `GlmMoeDsaForCausalLM` (eval). Its load report would list the MTP layer's
    tensors as unexpected (transformers builds no MTP module), so it is kept quiet."""
    from transformers import GlmMoeDsaForCausalLM
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return GlmMoeDsaForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    finally:
        hf_logging.set_verbosity(level)


def unfuse(name: str, value) -> dict:
    """One in-memory parameter → the checkpoint's tensors: {name: tensor}, or {name: shape} when
    `value` is a shape tuple. Anything but the fused experts passes through."""
    shapes_only = isinstance(value, tuple)
    shape = value if shapes_only else tuple(value.shape)
    out = {}
    if name.endswith(GATE_UP):
        prefix, (experts, two_i, hidden) = name[: -len("gate_up_proj")], shape
        inter = two_i // 2
        for e in range(experts):
            for part, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, two_i))):
                out[f"{prefix}{e}.{part}.weight"] = (inter, hidden) if shapes_only else value[e, rows].clone()
    elif name.endswith(DOWN):
        prefix, (experts, hidden, inter) = name[: -len("down_proj")], shape
        for e in range(experts):
            out[f"{prefix}{e}.down_proj.weight"] = (hidden, inter) if shapes_only else value[e].clone()
    else:
        out[name] = value
    return out


def fuse(weights: dict[str, torch.Tensor], hf_model) -> dict[str, torch.Tensor]:
    """Checkpoint names (experts one by one) → the in-memory layout of `hf_model`."""
    out = dict(weights)
    for name, param in hf_model.named_parameters():
        if name.endswith(GATE_UP):
            prefix = name[: -len("gate_up_proj")]
            out[name] = torch.stack([torch.cat([out.pop(f"{prefix}{e}.gate_proj.weight"),
                                                out.pop(f"{prefix}{e}.up_proj.weight")]) for e in range(param.shape[0])])
        elif name.endswith(DOWN):
            prefix = name[: -len("down_proj")]
            out[name] = torch.stack([out.pop(f"{prefix}{e}.down_proj.weight") for e in range(param.shape[0])])
    return out
