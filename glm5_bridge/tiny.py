"""Tiny random GLM-5 / 5.1 / 5.2 HF checkpoints: `glm5-bridge make-tiny`, the demo, notebooks, tests.

The shapes keep every structural feature of the real models (MLA with q/kv LoRA ranks, the DSA
indexer with interleaved rope, dense + MoE layers with a shared expert and a sigmoid router with
correction bias, one MTP layer, and for GLM-5.2 the IndexShare schedule of the real config) at a
size that builds and runs on a CPU in a second.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from glm5_bridge.hf import unfuse

VARIANTS = ("GLM-5", "GLM-5.1", "GLM-5.2")

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=7,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    # 16 indexer heads: with few heads, relu(q.k) is zero for every head on a noticeable share of
    # keys, and the resulting score ties make top-k order implementation-defined.
    index_n_heads=16,
    index_head_dim=16,
    index_topk=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    max_position_embeddings=4096,
    initializer_range=0.1,
)


def tiny_config_dict(variant: str = "GLM-5.2", **overrides) -> dict:
    """The preset's config.json values with tiny sizes (IndexShare schedule recomputed)."""
    from glm5_bridge.model.config import load_preset_dict

    cfg = load_preset_dict(variant)
    cfg.update(TINY)
    cfg.update(overrides)
    cfg["qk_head_dim"] = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    cfg["head_dim"] = cfg["qk_rope_head_dim"]
    cfg["eos_token_id"] = 1
    cfg["pad_token_id"] = None
    cfg["dtype"] = "float32"
    if "indexer_types" in cfg:
        freq, offset = cfg["index_topk_freq"], cfg["index_skip_topk_offset"]
        cfg["indexer_types"] = [
            "full" if max(i - offset + 1, 0) % freq == 0 else "shared"
            for i in range(cfg["num_hidden_layers"])
        ]
    return cfg


def _mtp_layer_tensors(model, cfg: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """HF stores the MTP layer as `model.layers.{num_hidden_layers}`: a full decoder layer (its own
    indexer included) plus enorm, hnorm, eh_proj and shared_head.norm. transformers builds no MTP
    module, so the tensors are made here from a copy of the last layer's structure."""
    from transformers import GlmMoeDsaConfig
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer

    n = cfg["num_hidden_layers"]
    layer_cfg = dict(cfg)
    layer_cfg["num_hidden_layers"] = n + 1
    layer_cfg["indexer_types"] = ["full"] * (n + 1)  # the MTP layer always owns an indexer
    layer_cfg["mlp_layer_types"] = ["dense"] * cfg["first_k_dense_replace"] + ["sparse"] * (
        n + 1 - cfg["first_k_dense_replace"])
    layer = GlmMoeDsaDecoderLayer(GlmMoeDsaConfig(**layer_cfg), n)
    out = {}
    for name, t in layer.state_dict().items():
        # Checkpoints keep experts one by one (transformers fuses them only in memory).
        out.update(unfuse(f"model.layers.{n}.{name}", _random_like(name, t, cfg, generator)))
    h = cfg["hidden_size"]
    out[f"model.layers.{n}.enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=generator)
    out[f"model.layers.{n}.hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=generator)
    out[f"model.layers.{n}.shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=generator)
    out[f"model.layers.{n}.eh_proj.weight"] = cfg["initializer_range"] * torch.randn(h, 2 * h, generator=generator)
    return out


def _random_like(name: str, t: torch.Tensor, cfg: dict, generator: torch.Generator) -> torch.Tensor:
    std = cfg["initializer_range"]
    if name.endswith("e_score_correction_bias"):
        return 0.05 * torch.randn(t.shape, generator=generator)
    if "norm" in name and name.endswith("bias"):
        return 0.1 * torch.randn(t.shape, generator=generator)
    if "norm" in name:  # RMSNorm / LayerNorm weights: around one, not exactly one
        return 1 + 0.1 * torch.randn(t.shape, generator=generator)
    return std * torch.randn(t.shape, generator=generator)


def make_tiny_model(variant: str = "GLM-5.2", seed: int = 0, **overrides):
    """A tiny random `GlmMoeDsaForCausalLM` (fp32) and the extra MTP tensors for its checkpoint."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    cfg = tiny_config_dict(variant, **overrides)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**cfg)).float().eval()
    with torch.no_grad():
        for name, p in model.state_dict().items():
            p.copy_(_random_like(name, p, cfg, generator))
    return model, _mtp_layer_tensors(model, cfg, generator)


SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>")


def make_tiny_tokenizer(path: str | os.PathLike):
    """A character-level fast tokenizer (ids 0–4 special, then printable ASCII and newline) that
    fits the tiny vocab; bos = 0 and eos = 1 as in the tiny config."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: len(SPECIAL_TOKENS) + i for i, c in enumerate(chars)})
    vocab["<unk>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", unk_token="<unk>",
                                   additional_special_tokens=list(SPECIAL_TOKENS[3:]))
    # The role tags of GLM's own chat template, without its system prompt and thinking markup.
    fast.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
        "{% else %}<|assistant|>{{ m['content'] }}<|eos|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    fast.save_pretrained(path)
    return fast


def make_tiny_checkpoint(variant: str, path: str | os.PathLike, seed: int = 0, overwrite: bool = False,
                         **overrides) -> Path:
    """Write a tiny random fp32 HF checkpoint of `variant` (with one MTP layer) to `path` (an empty
    or new folder, or with `overwrite` one this project wrote: files.check_output)."""
    from glm5_bridge.files import atomic_output_dir, check_output

    check_output(path, overwrite=overwrite)
    model, mtp = make_tiny_model(variant, seed, **overrides)
    with atomic_output_dir(path, overwrite, collective=False) as tmp:
        _write_tiny_checkpoint(variant, model, mtp, tmp, **overrides)
    return Path(path)


def _write_tiny_checkpoint(variant: str, model, mtp: dict, path: Path, **overrides) -> None:
    from safetensors.torch import load_file, save_file

    model.save_pretrained(path, safe_serialization=True)
    # Append the MTP layer to the (single) shard and keep the real config's MTP fields.
    shard = path / "model.safetensors"
    tensors = load_file(shard)
    tensors.update({k: v.contiguous() for k, v in mtp.items()})
    save_file(tensors, shard, metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    for key in ("rope_interleave", "indexer_rope_interleave", "index_topk_freq", "index_skip_topk_offset"):
        if key in tiny_config_dict(variant, **overrides):
            cfg[key] = tiny_config_dict(variant, **overrides)[key]
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    make_tiny_tokenizer(path)
