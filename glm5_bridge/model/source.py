"""Where a GLM-5 model comes from, decided once: a preset name ("GLM-5", "GLM-5.1", "GLM-5.2": the
shipped copy of a real config.json, no weights) or an HF checkpoint folder (config.json, and
*.safetensors unless it is config-only). `resolve` reads and checks config.json; everything that
takes "a path or a preset" (config, validate, bridge, plan, the CLI) goes through it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

PRESETS_DIR = Path(__file__).parent / "presets"
PRESETS = ("GLM-5", "GLM-5.1", "GLM-5.2")
MODEL_TYPE = "glm_moe_dsa"
ARCHITECTURE = "GlmMoeDsaForCausalLM"
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that does not match what its config.json implies (one line)."""


@dataclass(frozen=True)
class Source:
    name: str  # as the caller gave it
    config: dict  # config.json's values, checked to be a GLM-5.x config
    folder: Path | None  # the checkpoint folder; None for a preset

    @property
    def has_weights(self) -> bool:
        """A folder with safetensors weights (the only weights read: pickles can run code on load)."""
        return self.folder is not None and ((self.folder / INDEX_NAME).is_file() or any(self.folder.glob("*.safetensors")))


def load_preset_dict(name: str) -> dict:
    """The shipped copy of a real config.json ("GLM-5", "GLM-5.1", "GLM-5.2")."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {', '.join(PRESETS)}")
    return json.loads((PRESETS_DIR / f"{name}.json").read_text())


def resolve(path_or_preset: str | os.PathLike) -> Source:
    """A preset name, a checkpoint folder or its config.json → `Source` (one-line errors)."""
    name = str(path_or_preset)
    if name in PRESETS:
        return Source(name, load_preset_dict(name), None)
    path = Path(path_or_preset)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint folder (and not a preset: {', '.join(PRESETS)})")
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a folder (an HF checkpoint is a folder with config.json and *.safetensors)")
    return Source(name, read_config(path), path)


def read_config(path: str | os.PathLike) -> dict:
    """config.json of a checkpoint folder (or the file itself), checked to be a GLM-5.x config."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file}: not found (an HF checkpoint folder holds config.json and *.safetensors)")
    try:
        config = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(config).__name__}")
    model_type, archs = config.get("model_type"), config.get("architectures")
    if model_type != MODEL_TYPE:
        raise CheckpointError(f"{file}: model_type is {model_type!r}, expected {MODEL_TYPE!r} (GLM-5 / 5.1 / 5.2)")
    if archs is not None and ARCHITECTURE not in archs:
        raise CheckpointError(f"{file}: architectures is {archs}, expected [{ARCHITECTURE!r}]")
    try:  # what transformers (and so megatron-bridge) will make of it
        from transformers import GlmMoeDsaConfig

        GlmMoeDsaConfig(**hf_kwargs(config))
    except Exception as e:
        detail = " ".join(str(getattr(e, "__cause__", None) or e).split())
        raise CheckpointError(f"{file}: transformers rejects this config ({detail})") from None
    _check_sizes(file, config)
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise NotImplementedError(f"{file}: quantized checkpoints ({method}) are not supported; use the bf16 release "
                                  "(megatron-bridge's GLM-5 mapping has no dequantization)")
    return config


# Sizes transformers accepts without a word but no GLM-5.x model can have (each >= 1).
POSITIVE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "index_topk",
                  "index_n_heads", "index_head_dim")


def _check_sizes(file: Path, config: dict) -> None:
    for key in POSITIVE_SIZES:
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise CheckpointError(f"{file}: {key} is {value!r}, expected a whole number >= 1")
    if config.get("num_experts_per_tok", 0) > config.get("n_routed_experts", 1 << 30):
        raise CheckpointError(f"{file}: num_experts_per_tok {config['num_experts_per_tok']} exceeds n_routed_experts "
                              f"{config['n_routed_experts']}")


def hf_kwargs(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in ("architectures", "model_type", "transformers_version")}
