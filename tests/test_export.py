"""Export after LoRA (glm5_bridge/train/export.py), checked against transformers (merged checkpoint) and
transformers + PEFT (adapter) on the same input: Megatron + LoRA logits must equal both within
1e-5 max abs (fp32, CPU). Every adapter gets random non-zero A and B first, so a dropped or
mis-mapped delta shows (the LoRA moves the logits by more than 1e-2). The base checkpoint's files
are hashed before and after: exporting never writes to it.
"""

import hashlib
import json

import pytest
import torch
from safetensors import safe_open

from glm5_bridge.files import OUTPUT_MARKER
from glm5_bridge.train.export import export_adapter, export_merged
from glm5_bridge.train.lora import GLM5LoRA, lora_parameters, lora_targets
from glm5_bridge.testing import load_hf, load_megatron, megatron_logits

TOL = 1e-5
VARIANTS = ["GLM-5", "GLM-5.2"]


def _ids(seq=40):
    return torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(11))


def _hashes(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _lora_model(path, targets, seed=0):
    """Megatron model with LoRA on `targets`, every adapter weight random and non-zero."""
    bridge, model = load_megatron(path)
    model = GLM5LoRA(dim=8, alpha=16, target_modules=targets)(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return bridge, model.eval()


def _no_leftovers(parent):
    return not [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def _tensors(folder):
    out = {}
    for shard in folder.glob("*.safetensors"):
        with safe_open(shard, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_merged_export_equals_megatron_lora(tiny_checkpoint, tmp_path, variant):
    base_path = tiny_checkpoint(variant)
    before = _hashes(base_path)
    all_groups = lora_targets(dense_mlp=True, shared_experts=True, experts=True)
    bridge, model = _lora_model(base_path, all_groups)
    ids = _ids()
    with torch.no_grad():
        ours = megatron_logits(model, ids)
        base_logits = load_hf(base_path)(input_ids=ids).logits

    out = export_merged(bridge, model, tmp_path / "merged")

    files = {p.name for p in out.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"} <= files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    merged = _tensors(out)
    assert set(index["weight_map"]) == set(merged)
    assert all((out / shard).is_file() for shard in set(index["weight_map"].values()))
    with torch.no_grad():
        ref = load_hf(out)(input_ids=ids).logits
    assert (ours - ref).abs().max().item() <= TOL
    assert (ours - base_logits).abs().max().item() > 1e-2

    # Only the adapted HF weights differ from the base checkpoint; everything else is bit-identical.
    base = _tensors(base_path)
    assert set(merged) == set(base)
    adapted = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
               "down_proj")
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed == {k for k in base if any(f".{name}." in k for name in adapted)}
    assert _hashes(base_path) == before
    assert _no_leftovers(tmp_path)


@pytest.mark.parametrize("variant", VARIANTS)
def test_adapter_export_equals_megatron_lora_under_peft(tiny_checkpoint, tmp_path, variant):
    from peft import PeftModel

    base_path = tiny_checkpoint(variant)
    before = _hashes(base_path)
    bridge, model = _lora_model(base_path, lora_targets())  # the MLA projections
    ids = _ids()
    with torch.no_grad():
        ours = megatron_logits(model, ids)

    out = export_adapter(bridge, model, tmp_path / "adapter")

    assert {p.name for p in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors", "README.md",
                                               OUTPUT_MARKER}
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 16)
    assert config["base_model_name_or_path"] == str(base_path.resolve())
    card = (out / "README.md").read_text()
    assert f'base_model: "{base_path.resolve()}"' in card and "library_name: peft" in card
    assert "- LoRA: dim 8, alpha 16, dropout 0.0" in card
    assert sorted(config["target_modules"]) == sorted(["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                       "o_proj"])
    with safe_open(out / "adapter_model.safetensors", framework="pt") as f:
        keys = list(f.keys())
    assert len(keys) == 2 * 5 * 7  # A and B of 5 projections in 7 decoder layers (MTP left out)
    assert all(k.startswith("base_model.model.model.layers.") for k in keys)

    hf = load_hf(base_path)
    with torch.no_grad():
        base_logits = hf(input_ids=ids).logits
        ref = PeftModel.from_pretrained(hf, out)(input_ids=ids).logits
    assert (ours - ref).abs().max().item() <= TOL
    assert (ours - base_logits).abs().max().item() > 1e-2
    assert _hashes(base_path) == before
    assert _no_leftovers(tmp_path)


def test_existing_targets_base_checkpoint_and_failures(tiny_checkpoint, tmp_path, monkeypatch):
    base_path = tiny_checkpoint("GLM-5.2")
    before = _hashes(base_path)
    bridge, model = _lora_model(base_path, lora_targets())
    target = tmp_path / "adapter"
    export_adapter(bridge, model, target)
    first = _hashes(target)

    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_adapter(bridge, model, target)
    for inside in (base_path, base_path / "merged"):
        with pytest.raises(FileExistsError, match=f"{base_path.resolve()}, which this command reads"):
            export_merged(bridge, model, inside, overwrite=True)
    assert _hashes(base_path) == before

    # A failing write leaves the old target as it was and no temporary folder behind.
    def fail(*args, **kwargs):
        (args[1] / "adapter_model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(bridge, "save_hf_adapter", fail)
    with pytest.raises(OSError, match="disk full"):
        export_adapter(bridge, model, target, overwrite=True)
    with pytest.raises(OSError, match="disk full"):
        export_adapter(bridge, model, tmp_path / "new")
    monkeypatch.undo()
    assert _hashes(target) == first and not (tmp_path / "new").exists() and _no_leftovers(tmp_path)

    # overwrite=True replaces the target (new LoRA values → different adapter file).
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.mul_(2)
    export_adapter(bridge, model, target, overwrite=True)
    assert _hashes(target)["adapter_model.safetensors"] != first["adapter_model.safetensors"]
    assert _no_leftovers(tmp_path)


def test_adapter_export_refuses_mlp_lora(tiny_checkpoint, tmp_path):
    """PEFT maps gate/up/down_proj targets of glm_moe_dsa onto the fused routed experts, so an MLP
    adapter cannot load correctly: refused before anything is written."""
    bridge, model = _lora_model(tiny_checkpoint("GLM-5.2"), lora_targets(shared_experts=True))
    with pytest.raises(NotImplementedError, match="export_merged"):
        export_adapter(bridge, model, tmp_path / "adapter")
    assert not list(tmp_path.iterdir())


def test_base_model_id_is_the_hub_id_a_config_names(tmp_path):
    from glm5_bridge.train.model_card import base_model_id

    (tmp_path / "config.json").write_text(json.dumps({"_name_or_path": "zai-org/GLM-5.2"}))
    assert base_model_id(tmp_path) == "zai-org/GLM-5.2"
    (tmp_path / "config.json").write_text(json.dumps({"_name_or_path": "/data/GLM-5.2"}))  # a local path: not an id
    assert base_model_id(tmp_path) == str(tmp_path.resolve())
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert base_model_id(tmp_path) == str(tmp_path.resolve())
