"""Export a (LoRA-)trained Megatron GLM-5 model back to Hugging Face.

    export_merged(bridge, model, "out/merged")    # HF checkpoint, LoRA deltas folded into the weights
    export_adapter(bridge, model, "out/adapter")  # HF PEFT adapter: PeftModel.from_pretrained(base, path)

Both are megatron-bridge's own writers (`AutoBridge.save_hf_pretrained` with adapter merging,
`AutoBridge.save_hf_adapter`) wrapped so that:
  - the result appears all at once: files are written into a temporary folder next to the
    target, fsynced, then renamed into place; a failure leaves no partial target behind;
  - an existing target is refused unless `overwrite=True`, and then replaced (again by rename) only
    if this project wrote it; a target that is, contains or lies inside the base checkpoint (or
    another input named in `reads`, such as the run folder) is refused (files.check_output);
  - a merged checkpoint always has `model.safetensors.index.json` (upstream keeps the base
    checkpoint's shard layout and writes an index only when the base had one).

Both are collective: every rank calls them (TP/PP/EP shards are gathered); rank 0 writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

from glm5_bridge.files import atomic_output_dir
from glm5_bridge.model.source import INDEX_NAME
from glm5_bridge.train.lora import lora_parameters
from glm5_bridge.train.model_card import base_model_id


ADAPTER_MLP_UNSUPPORTED = (
    "export_adapter: the model has LoRA on MLP projections ({example}, …). PEFT 0.21 with transformers "
    "5.23 rewrites every gate_proj/up_proj/down_proj target of a glm_moe_dsa model into the fused "
    "routed-expert parameters (transformers' qwen2_moe conversion pattern), so such an adapter would load "
    "into the wrong weights or not at all. Export it with export_merged, or train LoRA on the attention "
    "projections only (lora_targets(), the default).")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _base_checkpoint(bridge) -> Path | None:
    source = getattr(bridge.hf_pretrained, "model_name_or_path", None)
    return Path(source).resolve() if source and Path(source).exists() else None


def _atomic_export(bridge, out_dir, overwrite: bool, reads, write) -> Path:
    """Run `write(tmp_dir)` on every rank inside files.atomic_output_dir: the target is checked
    against the base checkpoint and `reads` first, and appears whole or not at all."""
    out = Path(out_dir).resolve()
    base = _base_checkpoint(bridge)
    with atomic_output_dir(out, overwrite, reads=[*([base] if base else []), *reads]) as tmp:
        write(tmp)
    return out


def _write_index_if_missing(folder: Path) -> None:
    """An index for a checkpoint whose tensors sit in plain *.safetensors files."""
    if (folder / INDEX_NAME).exists():
        return
    from safetensors import safe_open

    weight_map, total = {}, 0
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():
                weight_map[key] = shard.name
                sl = f.get_slice(key)
                numel = 1
                for n in sl.get_shape():
                    numel *= n
                total += numel * _dtype_bytes(sl.get_dtype())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _dtype_bytes(dtype: str) -> int:
    return {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
            "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}[dtype]


def _chunks(model) -> list:
    return model if isinstance(model, list) else [model]


def _write_card(folder: Path, kind: str, bridge, model, recipe, history) -> None:
    """README.md: the model card (train/model_card.py); `recipe` and `history` add the recipe and
    the final metrics when the caller has them."""
    from glm5_bridge.train.model_card import model_card

    lora = None
    if lora_parameters(model):
        try:
            lora = vars(_adapter_hyperparameters(model))
        except NotImplementedError:  # adapters with differing alphas: the card leaves the line out
            pass
    recipe_yaml = None
    if recipe is not None:
        from glm5_bridge.train.recipe import to_yaml

        recipe_yaml = to_yaml(recipe)
    card = model_card(kind, base_model_id(_base_checkpoint(bridge)), lora, recipe_yaml, history)
    (folder / "README.md").write_text(card)


def export_merged(bridge, model, out_dir, overwrite: bool = False, show_progress: bool = False,
                  reads=(), recipe=None, history=None) -> Path:
    """Write an HF checkpoint (safetensors shards + index, config, tokenizer and generation config)
    with every LoRA delta folded into its base weight, and a model card (README.md; with `recipe`
    and `history`, the recipe and final metrics too); loadable with
    `GlmMoeDsaForCausalLM.from_pretrained(out_dir)`. The MTP layer is kept (transformers ignores it).
    Without adapters this is a plain export. Returns the resolved target path."""

    def write(tmp: Path) -> None:
        bridge.save_hf_pretrained(_chunks(model), tmp, show_progress=show_progress, merge_adapter_weights=True)
        if _rank() == 0:
            _write_index_if_missing(tmp)
            _write_card(tmp, "merged", bridge, model, recipe, history)

    return _atomic_export(bridge, out_dir, overwrite, reads, write)


def export_adapter(bridge, model, out_dir, overwrite: bool = False, include_mtp: bool = False,
                   show_progress: bool = False, reads=(), recipe=None, history=None) -> Path:
    """Write the LoRA adapters as an HF PEFT adapter (adapter_config.json + adapter_model.safetensors,
    HF module names, and a model card as export_merged), loadable with
    `peft.PeftModel.from_pretrained(hf_base_model, out_dir)`. `base_model_name_or_path` is the base's
    Hub id when its config.json names one, else its path.

    The MTP layer's adapters are left out unless `include_mtp` (transformers has no MTP module, so
    PEFT would report them as unexpected keys). Only attention-projection adapters are supported
    (see ADAPTER_MLP_UNSUPPORTED). Returns the resolved target path."""
    names = list(lora_parameters(model))
    if not names:
        raise ValueError("export_adapter: the model has no LoRA adapters (apply glm5_bridge.train.lora.GLM5LoRA first)")
    mlp = [n for n in names if ".mlp." in n]
    if mlp:
        raise NotImplementedError(ADAPTER_MLP_UNSUPPORTED.format(example=mlp[0].split(".adapter.")[0]))
    peft_config = _adapter_hyperparameters(model)
    base = _base_checkpoint(bridge)

    def write(tmp: Path) -> None:
        bridge.save_hf_adapter(_chunks(model), tmp, peft_config=peft_config,
                               base_model_name_or_path=base_model_id(base), show_progress=show_progress,
                               exclude_adapter_base_prefixes=None if include_mtp else ("mtp.",))
        if _rank() == 0:
            _write_card(tmp, "adapter", bridge, model, recipe, history)

    return _atomic_export(bridge, out_dir, overwrite, reads, write)


def _adapter_hyperparameters(model) -> SimpleNamespace:
    """rank, alpha and dropout as `save_hf_adapter` reads them from a PEFT config, taken from the
    adapters themselves. PEFT scales each module by lora_alpha / its rank (upstream writes differing
    ranks as rank_pattern), so one alpha must hold for all adapters."""
    adapters = [m.adapter for chunk in _chunks(model) for m in chunk.modules()
                if hasattr(getattr(m, "adapter", None), "dim")]
    alphas = {a.alpha for a in adapters}
    if len(alphas) > 1:
        raise NotImplementedError(f"export_adapter: adapters have different alphas {sorted(alphas)}; "
                                  "a PEFT adapter_config.json holds one lora_alpha")
    dims = [a.dim for a in adapters]
    return SimpleNamespace(dim=max(set(dims), key=dims.count), alpha=alphas.pop(),
                           dropout=max(getattr(a.dropout, "p", 0.0) for a in adapters))
