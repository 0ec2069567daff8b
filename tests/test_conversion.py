"""HF → Megatron → HF is lossless for every variant, and the model structure follows config.json."""

import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as half_split_rope

from glm5_bridge.testing import VARIANTS, load_hf, load_megatron, megatron_logits


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("variant", VARIANTS)
def test_round_trip_is_bit_exact(tiny_checkpoint, variant, tmp_path):
    path = tiny_checkpoint(variant)
    before = _digest(path)
    bridge, model = load_megatron(path)
    source = load_file(path / "model.safetensors")
    exported = dict(bridge.export_hf_weights([model], cpu=True, show_progress=False))
    assert set(exported) == set(source)
    assert any(".layers.7." in k for k in exported), "MTP layer (HF index 7) must round-trip"
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    bridge.save_hf_pretrained([model], tmp_path / "out")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert set(saved) == set(source) and all(torch.equal(saved[k], source[k]) for k in source)
    assert _digest(path) == before, "the source checkpoint must not change"


def test_indexshare_layers_own_no_indexer_and_mtp_does(tiny_checkpoint):
    _, model = load_megatron(tiny_checkpoint("GLM-5.2"))
    types = json.loads((tiny_checkpoint("GLM-5.2") / "config.json").read_text())["indexer_types"]
    for i, layer in enumerate(model.decoder.layers):
        core = layer.self_attention.core_attention
        assert (core.indexer is not None) == (types[i] == "full"), i
    mtp_core = model.mtp.layers[0].mtp_model_layer.self_attention.core_attention
    assert mtp_core.indexer is not None and mtp_core.is_mtp_layer


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_missing_indexer_rope_key_takes_transformers_default(tiny_checkpoint, tmp_path):
    """megatron-bridge 0.6.2 raised AttributeError here; the default is interleaved (transformers 5.23)."""
    path = _with_config(tiny_checkpoint("GLM-5"), tmp_path / "ckpt", indexer_rope_interleave=None)
    bridge, model = load_megatron(path)
    assert model.config.dsa_indexer_rope_interleaved is True
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (megatron_logits(model.eval(), ids) - load_hf(path)(input_ids=ids).logits).abs().max().item()
    assert diff <= 1e-5


def test_indexer_rope_half_split(tiny_checkpoint, tmp_path, monkeypatch):
    """`indexer_rope_interleave: false` → half-split rope in the indexer. Reference: transformers
    5.23 with its indexer rope swapped for the half-split one, i.e. transformers 5.12.1's indexer."""
    path = _with_config(tiny_checkpoint("GLM-5.2"), tmp_path / "ckpt", indexer_rope_interleave=False)
    _, model = load_megatron(path)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    original_forward = modeling_glm_moe_dsa.GlmMoeDsaIndexer.forward

    interleaved_rope = modeling_glm_moe_dsa.apply_rotary_pos_emb_interleave

    def indexer_forward_5_12(self, *args, **kwargs):
        # Only the indexer's rope changes; the main attention keeps the interleaved one.
        modeling_glm_moe_dsa.apply_rotary_pos_emb_interleave = half_split_rope
        try:
            return original_forward(self, *args, **kwargs)
        finally:
            modeling_glm_moe_dsa.apply_rotary_pos_emb_interleave = interleaved_rope

    hf = load_hf(path)
    with torch.no_grad():
        ours = megatron_logits(model.eval(), ids)
        interleaved_ref = hf(input_ids=ids).logits
        monkeypatch.setattr(modeling_glm_moe_dsa.GlmMoeDsaIndexer, "forward", indexer_forward_5_12)
        half_split_ref = hf(input_ids=ids).logits
    assert (ours - half_split_ref).abs().max().item() <= 1e-5
    assert (ours - interleaved_ref).abs().max().item() > 1e-3  # the flag matters at this length


def test_pipeline_stage_must_start_on_a_full_layer():
    from glm5_bridge.model.config import check_stage_starts

    types = ["full", "full", "full", "shared", "shared", "shared", "full"]
    check_stage_starts(types, [0, 6])
    with pytest.raises(ValueError, match="starts at layer 4, an IndexShare 'shared' layer"):
        check_stage_starts(types, [0, 4])
