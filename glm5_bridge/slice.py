"""Real-width slices of GLM-5.x: `glm5-bridge make-slice GLM-5.2 DIR --layers 4 --experts 16`.

A random HF checkpoint with the preset's exact config (hidden 6144, 64 heads, q_lora 2048, kv_lora
512, rope 64, nope 192, v 256, indexer 32 × 128, top-k 2048, vocab 154 880, rope_interleave, the MTP
layer) except the decoder layer count, which keeps the first N layers of the IndexShare schedule,
and optionally the routed-expert count: a GLM-5.2 MoE layer holds 256 × 37.7M expert weights (19 GB
in bf16), so a slice that must fit one GPU and a 64 GB disk several times over (HF, Megatron, the
HF round trip, a merged export) keeps top-8 routing over fewer experts. bf16 shards of at most
`shard_gb` with model.safetensors.index.json, and the tokenizer of the tiny models (character
level, ids below 102; the embedding keeps all 154 880 rows).

Scale. Random weights at the config's initializer_range (0.02) alone would give attention logits of std ~0.8
and next-token logits of std ~1.6 over 154 880 ids: near-uniform softmaxes, on which bf16 rounding
moves nothing that matters. Trained models are peakier, so two groups are drawn wider (std of the
normalised-input dot products, RMSNorm outputs having unit RMS):
  - q_b_proj at 5 × 0.02: q entries ~4.5, attention logits (q·k over 192 nope + 64 rope dims / 16) std ~4,
    so a query's top key outweighs the median one by e^10 or more;
  - lm_head at 2.5 × 0.02: next-token logits std ~3.9 (max ~ +20 over the mean).
Everything else is at initializer_range; norm weights 1 ± 0.1, norm biases and the router's
correction bias small (the latter in float32, as real checkpoints store it).
The tensors are generated one at a time (on the GPU when there is one) in float32 and rounded to
bf16, so host memory holds at most one shard.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

WIDER = {"q_b_proj": 5.0, "lm_head": 2.5}  # × initializer_range; see the module docstring
FP32_TENSORS = ("e_score_correction_bias",)  # stored in float32 by the real checkpoints (as DeepSeek-V3's)


def slice_config(variant: str, layers: int, experts: int | None = None) -> dict:
    """The preset's config.json with `layers` decoder layers (its IndexShare schedule's first N)
    and `experts` routed experts (default: the preset's)."""
    from glm5_bridge.model.config import load_preset_dict

    cfg = load_preset_dict(variant)
    if layers < 1:
        raise ValueError(f"--layers must be at least 1, got {layers}")
    top = cfg["num_experts_per_tok"]
    if experts is not None and not top <= experts <= cfg["n_routed_experts"]:
        raise ValueError(f"--experts must be between num_experts_per_tok ({top}) and {cfg['n_routed_experts']}, "
                         f"got {experts}")
    cfg["num_hidden_layers"] = layers
    cfg["n_routed_experts"] = experts or cfg["n_routed_experts"]
    if "indexer_types" in cfg:
        cfg["indexer_types"] = cfg["indexer_types"][:layers]
    cfg["dtype"] = "bfloat16"
    return cfg


def tensor_std(name: str, initializer_range: float) -> float | None:
    """Std of a weight matrix's random entries; None for norms and biases (drawn around 1 / 0)."""
    if "norm" in name or name.endswith("bias"):
        return None
    return initializer_range * next((f for key, f in WIDER.items() if key in name), 1.0)


def _random(name: str, shape: tuple, initializer_range: float, generator: torch.Generator, device) -> torch.Tensor:
    std = tensor_std(name, initializer_range)
    t = torch.randn(shape, generator=generator, device=device)
    if std is not None:
        t.mul_(std)
    elif name.endswith("bias"):
        t.mul_(0.05 if name.endswith("e_score_correction_bias") else 0.1)
    else:  # RMSNorm / LayerNorm weights: around one
        t.mul_(0.1).add_(1.0)
    return t.to(torch.float32 if name.endswith(FP32_TENSORS) else torch.bfloat16).cpu()


def _layer_key(name: str) -> tuple:
    """Checkpoint order: embeddings, then layer by layer (experts in number order), then the head."""
    natural = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))
    return (0 if "embed_tokens" in name and ".layers." not in name else 2 if name.startswith("lm_head") else 1,
            natural)


def make_slice_checkpoint(variant: str, path: str | os.PathLike, layers: int, experts: int | None = None,
                          seed: int = 0, overwrite: bool = False, shard_gb: float = 4.0, device=None,
                          **overrides) -> Path:
    """Write a real-width random bf16 HF checkpoint of `variant` (see the module docstring) to `path`.
    `overrides` change config values (tests use them to shrink the widths)."""
    from glm5_bridge.files import atomic_output_dir, check_output
    from glm5_bridge.model.validate import expected_tensors
    from glm5_bridge.tiny import make_tiny_tokenizer

    check_output(path, overwrite=overwrite)
    cfg = slice_config(variant, layers, experts)
    cfg.update(overrides)
    cfg["qk_head_dim"] = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]  # derived: keep it so under overrides
    required, _ = expected_tensors(cfg)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device=device).manual_seed(seed)
    names = sorted(required, key=_layer_key)
    limit = int(shard_gb * 1e9)
    with atomic_output_dir(path, overwrite, collective=False) as tmp:
        shards, current, size = [], {}, 0
        for name in names:
            current[name] = _random(name, required[name], cfg["initializer_range"], generator, device)
            size += current[name].numel() * current[name].element_size()
            if size >= limit:
                shards.append(_save_shard(current, tmp, len(shards)))
                current, size = {}, 0
        if current:
            shards.append(_save_shard(current, tmp, len(shards)))
        weight_map, total = {}, 0
        for i, (file, tensors) in enumerate(shards):
            final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            (tmp / file).rename(tmp / final)
            weight_map.update({n: final for n in tensors})
            total += sum(tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        make_tiny_tokenizer(tmp)
    return Path(path)


def _save_shard(tensors: dict, folder: Path, number: int) -> tuple[str, dict]:
    """tensors → folder/shard-{number}.safetensors; (its name, tensor name → bytes)."""
    from safetensors.torch import save_file

    name = f"shard-{number}.safetensors"
    save_file(tensors, folder / name, metadata={"format": "pt"})
    return name, {n: t.numel() * t.element_size() for n, t in tensors.items()}
