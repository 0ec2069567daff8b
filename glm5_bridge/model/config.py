"""HF config normalisation for the GLM-5 family: defaults and the IndexShare schedule (where a
config comes from, a preset or a folder: source.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glm5_bridge.model.source import PRESETS, load_preset_dict, resolve

__all__ = ["PRESETS", "load_preset_dict", "load_hf_config", "indexer_types", "topk_source_layers", "check_stage_starts",
           "rope_interleave", "indexer_rope_interleave", "rope_theta", "num_mtp_layers"]

# transformers' GlmMoeDsaConfig default when a config has neither `indexer_types` nor
# `index_topk_pattern` nor `index_skip_topk_offset` (megatron-bridge 0.6.2 uses 0 instead).
DEFAULT_SKIP_TOPK_OFFSET = 2


def load_hf_config(path_or_preset: str | Path):
    """A `GlmMoeDsaConfig` from a checkpoint folder, a config.json path or a preset name."""
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(**resolve(path_or_preset).config)


def _get(hf_config: Any, key: str, default=None):
    value = getattr(hf_config, key, None)
    return default if value is None else value


def indexer_types(hf_config: Any) -> list[str]:
    """Per decoder layer, "full" (runs its indexer) or "shared" (reuses the nearest earlier full
    layer's top-k). Precedence as in transformers: `indexer_types`, then `index_topk_pattern`
    ("F"/"S" string or list), then `index_topk_freq` / `index_skip_topk_offset` (default 2)."""
    n = hf_config.num_hidden_layers
    types = _get(hf_config, "indexer_types")
    if types is None:
        pattern = _get(hf_config, "index_topk_pattern")
        if pattern is not None:
            types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq = max(int(_get(hf_config, "index_topk_freq", 1)), 1)
            offset = int(_get(hf_config, "index_skip_topk_offset", DEFAULT_SKIP_TOPK_OFFSET))
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    types = list(types)
    if len(types) != n:
        raise ValueError(f"config.json: indexer_types has {len(types)} entries, num_hidden_layers is {n}")
    bad = sorted(set(types) - {"full", "shared"})
    if bad:
        raise ValueError(f"config.json: indexer_types entries must be 'full' or 'shared', got {bad}")
    if n and types[0] != "full":
        raise ValueError("config.json: indexer_types[0] must be 'full' (a shared layer needs an earlier full one)")
    return types


def topk_source_layers(types: list[str]) -> list[int]:
    """For each layer (0-based), the layer whose top-k it uses: itself when "full", else the
    nearest earlier "full" layer."""
    sources, last_full = [], 0
    for i, t in enumerate(types):
        if t == "full":
            last_full = i
        sources.append(last_full)
    return sources


def check_stage_starts(types: list[str], starts: list[int]) -> None:
    """A pipeline stage must start on a computing layer: top-k does not cross stages."""
    bad = [s for s in starts if types[s] != "full"]
    if bad:
        full = [i for i, t in enumerate(types) if t == "full"]
        raise ValueError(f"pipeline stage starts at layer {bad[0]}, an IndexShare 'shared' layer; its top-k would "
                         f"come from another stage. Start every stage on a 'full' layer: {full}")


def rope_interleave(hf_config: Any) -> bool:
    return bool(_get(hf_config, "rope_interleave", True))


def indexer_rope_interleave(hf_config: Any) -> bool:
    """Missing key: transformers 5.23's behaviour (interleaved, as every published config says)."""
    return bool(_get(hf_config, "indexer_rope_interleave", True))


def rope_theta(hf_config: Any) -> float:
    params = _get(hf_config, "rope_parameters") or {}
    return float(params.get("rope_theta", _get(hf_config, "rope_theta", 10000.0)))


def num_mtp_layers(hf_config: Any) -> int:
    return int(_get(hf_config, "num_nextn_predict_layers", 0))
