"""HF config normalisation: presets, transformers' defaults, the IndexShare schedule."""

import json

import pytest
from transformers import GlmMoeDsaConfig

from glm5_bridge.model.config import PRESETS, indexer_types, load_hf_config, load_preset_dict, topk_source_layers


def test_presets_are_real_config_values():
    g5, g51, g52 = (load_preset_dict(p) for p in PRESETS)
    assert g5["hidden_size"] == 6144 and g5["num_hidden_layers"] == 78 and g5["index_topk"] == 2048
    assert g5["n_routed_experts"] == 256 and g5["num_experts_per_tok"] == 8
    assert g5["rope_parameters"]["rope_theta"] == 1e6 and g52["rope_parameters"]["rope_theta"] == 8e6
    assert g51 == g5
    assert g52["index_topk_freq"] == 4 and g52["index_skip_topk_offset"] == 3
    assert load_hf_config("GLM-5.2").num_hidden_layers == 78


def test_glm52_schedule_matches_published_layout():
    types = indexer_types(load_hf_config("GLM-5.2"))
    full = [i for i, t in enumerate(types) if t == "full"]
    assert full[:5] == [0, 1, 2, 6, 10] and full[-1] == 74 and len(full) == 21
    assert all(t == "full" for t in indexer_types(load_hf_config("GLM-5")))


def test_freq_offset_without_indexer_types_uses_transformers_default_offset():
    # No index_skip_topk_offset: transformers (and we) use 2; megatron-bridge 0.6.2 used 0.
    cfg = GlmMoeDsaConfig(num_hidden_layers=8, index_topk_freq=2)
    ours = indexer_types(cfg)
    assert ours == cfg.indexer_types == ["full", "full", "shared", "full", "shared", "full", "shared", "full"]


def test_explicit_indexer_types_win_over_freq_and_pattern():
    cfg = GlmMoeDsaConfig(num_hidden_layers=4, indexer_types=["full", "shared", "full", "shared"], index_topk_freq=1)
    assert indexer_types(cfg) == ["full", "shared", "full", "shared"]
    cfg = GlmMoeDsaConfig(num_hidden_layers=4, index_topk_pattern="FSSF")
    assert indexer_types(cfg) == ["full", "shared", "shared", "full"]


def test_topk_sources():
    assert topk_source_layers(["full", "shared", "shared", "full", "shared"]) == [0, 0, 0, 3, 3]


@pytest.mark.parametrize("types, message", [
    (["full", "shared"], "has 2 entries"),
    (["shared", "full", "full"], "must be 'full'"),
    (["full", "maybe", "full"], "'full' or 'shared'"),
])
def test_bad_indexer_types_are_refused(types, message):
    cfg = GlmMoeDsaConfig(num_hidden_layers=3)
    cfg.indexer_types = types
    with pytest.raises(ValueError, match=message):
        indexer_types(cfg)


def test_unknown_preset_and_missing_config(tmp_path):
    with pytest.raises(ValueError, match="unknown preset 'GLM-6'"):
        load_preset_dict("GLM-6")
    with pytest.raises(FileNotFoundError, match=r"config.json: not found \(an HF checkpoint folder holds config.json"):
        load_hf_config(tmp_path)


def test_preset_json_is_what_load_hf_config_sees(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(load_preset_dict("GLM-5.2")))
    assert indexer_types(load_hf_config(tmp_path)) == indexer_types(load_hf_config("GLM-5.2"))


def test_tiny_overrides_reach_the_derived_sizes(tmp_path):
    """make_tiny_checkpoint(..., **overrides): the derived head sizes follow the overrides (the GPU
    tests build the kernels' widths this way) and the checkpoint validates."""
    import json

    from glm5_bridge.model.validate import validate_checkpoint
    from glm5_bridge.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("GLM-5.2", tmp_path / "k", kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128)
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["qk_head_dim"], cfg["head_dim"], cfg["kv_lora_rank"]) == (16 + 64, 64, 512)
    validate_checkpoint(path)
