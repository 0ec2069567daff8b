"""Cheap checks of an HF GLM-5.x checkpoint folder before anything heavy reads it.

    validate_checkpoint("/ckpt")        # config.json + every safetensors header; raises on the first problem

Only config.json, the index and the safetensors headers (a few KB per shard) are read; no tensor
data. The names, shapes and dtypes the config implies come from transformers' own
`GlmMoeDsaForCausalLM` built on the meta device (routed experts unfused into the per-expert names
checkpoints use) plus the MTP layer (`model.layers.{num_hidden_layers + i}`: a decoder layer with its
own indexer, enorm, hnorm, eh_proj, shared_head.norm; embed_tokens and shared_head.head optional).
Each problem is one line that names the file, the tensor and the shapes, e.g.

    /ckpt/model-00002.safetensors: tensor model.layers.3.self_attn.q_b_proj.weight has shape (32, 96), config implies (32, 128)

Errors are `CheckpointError` (a ValueError), or FileNotFoundError for missing files, so the CLI
prints them as one line and exits 2.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from glm5_bridge.hf import unfuse
from glm5_bridge.model.config import indexer_types
from glm5_bridge.model.source import INDEX_NAME, CheckpointError, Source, hf_kwargs, resolve

__all__ = ["CheckpointError", "validate_checkpoint", "expected_tensors", "read_header", "checkpoint_tensors"]


# safetensors dtype → bytes per element
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
               "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
# config.json "dtype" / "torch_dtype" → safetensors dtype
CONFIG_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# Besides the config's dtype a tensor may be float32 (released checkpoints keep e.g. the router bias in
# fp32) or bfloat16 (a bf16-trained export of an fp32 checkpoint keeps the source config).
ALSO_ACCEPTED_DTYPES = ("F32", "BF16")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


def _shape(shape) -> str:
    return "(" + ", ".join(str(int(n)) for n in shape) + ("," if len(shape) == 1 else "") + ")"


def expected_tensors(config: dict) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(required, optional): tensor name → shape, as a checkpoint of this config stores them."""
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer

    config = hf_kwargs(config)
    hf = GlmMoeDsaConfig(**config)
    required: dict[str, tuple] = {}
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(hf)
    for name, t in model.state_dict().items():
        required.update(unfuse(name, tuple(t.shape)))
    if getattr(hf, "tie_word_embeddings", False):
        required.pop("lm_head.weight", None)

    optional: dict[str, tuple] = {}
    n, h = hf.num_hidden_layers, hf.hidden_size
    for i in range(int(getattr(hf, "num_nextn_predict_layers", 0) or 0)):
        layer = n + i
        layer_cfg = dict(config, num_hidden_layers=layer + 1, indexer_types=["full"] * (layer + 1),
                         mlp_layer_types=["dense"] * hf.first_k_dense_replace
                         + ["sparse"] * (layer + 1 - hf.first_k_dense_replace))
        for key in ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset", "layer_types"):
            layer_cfg.pop(key, None)
        with torch.device("meta"):
            block = GlmMoeDsaDecoderLayer(GlmMoeDsaConfig(**layer_cfg), layer)
        for name, t in block.state_dict().items():
            required.update(unfuse(f"model.layers.{layer}.{name}", tuple(t.shape)))
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            required[f"model.layers.{layer}.{name}"] = (h,)
        required[f"model.layers.{layer}.eh_proj.weight"] = (h, 2 * h)
        # DeepSeek-style MTP copies of the embedding and the output head (unused: Megatron shares them).
        optional[f"model.layers.{layer}.embed_tokens.weight"] = (hf.vocab_size, h)
        optional[f"model.layers.{layer}.shared_head.head.weight"] = (hf.vocab_size, h)
    return required, optional


def read_header(file: str | os.PathLike) -> dict[str, tuple[str, tuple]]:
    """tensor name → (safetensors dtype, shape) from a safetensors file's header, checking that the
    file holds every byte the header describes (a truncated download fails here, not mid-load)."""
    file = Path(file)
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: truncated or not a safetensors file ({size} bytes)")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"{file}: truncated or not a safetensors file (header of {n} bytes, "
                                  f"file of {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CheckpointError(f"{file}: corrupt safetensors header (not JSON)") from None
    data_bytes, out, end = size - 8 - n, {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, stop) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: corrupt safetensors header entry for tensor {name}") from None
        need = math.prod(shape) * DTYPE_BYTES.get(dtype, 0)
        if dtype not in DTYPE_BYTES or stop - begin != need:
            raise CheckpointError(f"{file}: corrupt safetensors header: tensor {name} ({dtype} {_shape(shape)}) "
                                  f"spans {stop - begin} bytes")
        out[name] = (dtype, shape)
        end = max(end, stop)
    if end > data_bytes:
        raise CheckpointError(f"{file}: truncated: the header describes {end} bytes of tensor data, the file holds "
                              f"{data_bytes}")
    return out


def checkpoint_tensors(folder: str | os.PathLike) -> dict[str, tuple[Path, str, tuple]]:
    """tensor name → (file, dtype, shape) over the shards of an HF checkpoint folder: the files
    `model.safetensors.index.json` names when there is one, else every *.safetensors file."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    out: dict[str, tuple[Path, str, tuple]] = {}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict)
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AssertionError):
            raise CheckpointError(f"{index}: not a safetensors index (no JSON 'weight_map' object)") from None
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(shard, []).append(name)
        for shard, names in sorted(shards.items()):
            file = folder / shard
            if Path(shard).name != shard or not file.is_file():
                raise FileNotFoundError(f"{index}: names shard {shard} ({len(names)} tensors, e.g. {names[0]}), "
                                        f"which is missing from {folder}")
            header = read_header(file)
            for name in names:
                if name not in header:
                    raise CheckpointError(f"{index}: lists tensor {name} in {shard}, which does not contain it")
                out[name] = (file, *header[name])
        return out
    for file in sorted(folder.glob("*.safetensors")):
        for name, (dtype, shape) in read_header(file).items():
            if name in out:
                raise CheckpointError(f"{file}: tensor {name} is also in {out[name][0].name}")
            out[name] = (file, dtype, shape)
    return out


def validate_checkpoint(path: str | os.PathLike | Source, weights: bool = True) -> dict:
    """Check an HF GLM-5.x checkpoint folder against its config.json; return the config dict.
    With `weights`, a folder that has safetensors files must hold exactly the tensors the config
    implies, with the implied shapes and acceptable dtypes; a folder with none is config-only (the
    caller decides whether that is enough)."""
    source = path if isinstance(path, Source) else resolve(path)
    if source.folder is None:
        if weights:
            raise CheckpointError(f"{source.name!r} is a preset (a config.json, no weights); give the folder of a "
                                  "downloaded checkpoint")
        return source.config
    _check_indexer_types(source)
    if not weights:
        return source.config
    if not source.has_weights:
        pickled = sorted(p.name for p in source.folder.glob("*.bin")) + sorted(p.name for p in source.folder.glob("*.pt"))
        if pickled:
            raise CheckpointError(f"{source.folder}: has {pickled[0]} but no *.safetensors; only safetensors weights "
                                  "are read (pickle files can run code on load)")
        return source.config
    _compare(source.folder, source.config, checkpoint_tensors(source.folder))
    return source.config


def _check_indexer_types(source: Source) -> None:
    """IndexShare's per-layer list must fit the layer count (transformers accepts any list)."""
    from transformers import GlmMoeDsaConfig

    try:
        indexer_types(GlmMoeDsaConfig(**hf_kwargs(source.config)))
    except ValueError as e:
        raise CheckpointError(f"{source.folder / 'config.json'}: {str(e).removeprefix('config.json: ')}") from None


def _compare(folder: Path, config: dict, found: dict[str, tuple[Path, str, tuple]]) -> None:
    required, optional = expected_tensors(config)
    missing = [n for n in required if n not in found]
    extra = [n for n in found if n not in required and n not in optional]
    if missing and extra:
        raise CheckpointError(f"{found[extra[0]][0]}: has tensor {extra[0]} the config does not imply, and tensor "
                              f"{missing[0]} {_shape(required[missing[0]])} is missing (renamed?; "
                              f"{len(extra)} unexpected, {len(missing)} missing in all)")
    if missing:
        raise CheckpointError(f"{folder}: tensor {missing[0]} {_shape(required[missing[0]])} is missing "
                              f"({len(missing)} missing in all)")
    if extra:
        raise CheckpointError(f"{found[extra[0]][0]}: tensor {extra[0]} is not part of a GLM-5.x checkpoint of this "
                              f"config ({len(extra)} unexpected in all)")
    declared = config.get("dtype") or config.get("torch_dtype")
    accepted = {CONFIG_DTYPES.get(str(declared), "F32"), *ALSO_ACCEPTED_DTYPES}
    for name, (file, dtype, shape) in found.items():
        want = required.get(name, optional.get(name))
        if tuple(shape) != tuple(want):
            raise CheckpointError(f"{file}: tensor {name} has shape {_shape(shape)}, config implies {_shape(want)}")
        if dtype not in accepted:
            raise CheckpointError(f"{file}: tensor {name} has dtype {dtype}, config.json says dtype "
                                  f"{declared or 'unset'} (accepted: {', '.join(sorted(accepted))})")
