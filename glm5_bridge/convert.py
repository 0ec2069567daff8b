"""HF checkpoint ⇄ Megatron distributed checkpoint.

A Megatron checkpoint written here is a folder:
    weights/            megatron-core dist_checkpointing (torch_dist) of the GPTModel state
    hf/                 config.json, generation_config.json and tokenizer files of the source
    glm5_bridge.json    what wrote it and from where
so that it can be turned back into an HF checkpoint without the source at hand. Every write goes
to a temporary folder beside the target and is renamed into place at the end; the source is only
read.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja")
MARKER = "glm5_bridge.json"


@contextmanager
def atomic_output_dir(target: str | os.PathLike, overwrite: bool = False):
    """Yield a fresh temporary folder beside `target`; on success fsync its files and rename it to
    `target`. On any error the temporary folder is removed and `target` is left as it was."""
    target = Path(target)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target}: already exists (pass overwrite=True / --overwrite to replace it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for root, _, files in os.walk(tmp):
            for name in files:
                with open(os.path.join(root, name), "rb") as f:
                    os.fsync(f.fileno())
        if target.exists():
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def hf_to_megatron(hf_path: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False,
                   **provider_overrides) -> Path:
    """Convert an HF GLM-5.x checkpoint into a Megatron distributed checkpoint at `out_dir`."""
    from megatron.core import dist_checkpointing

    from glm5_bridge.bridge import build_megatron_model

    hf_path = Path(hf_path)
    _, model = build_megatron_model(hf_path, **provider_overrides)
    with atomic_output_dir(out_dir, overwrite) as tmp:
        (tmp / "weights").mkdir()
        print(f"saving Megatron distributed checkpoint → {out_dir}/weights")
        dist_checkpointing.save(model.sharded_state_dict(), str(tmp / "weights"))
        (tmp / "hf").mkdir()
        for name in HF_SIDE_FILES:
            if (hf_path / name).is_file():
                shutil.copy2(hf_path / name, tmp / "hf" / name)
        (tmp / MARKER).write_text(json.dumps({"format": "megatron-core dist_checkpointing (torch_dist)",
                                              "source": str(hf_path.resolve()), **{k: str(v) for k, v in
                                                                                  provider_overrides.items()}},
                                             indent=2))
    return Path(out_dir)


def load_megatron_checkpoint(megatron_dir: str | os.PathLike, **provider_overrides):
    """(bridge, model) with the weights of a checkpoint written by `hf_to_megatron`."""
    from megatron.core import dist_checkpointing

    from glm5_bridge.bridge import build_megatron_model

    megatron_dir = Path(megatron_dir)
    if not (megatron_dir / MARKER).is_file():
        raise FileNotFoundError(f"{megatron_dir}: not a glm5-bridge Megatron checkpoint (no {MARKER})")
    bridge, model = build_megatron_model(megatron_dir / "hf", load_weights=False, **provider_overrides)
    print(f"loading Megatron distributed checkpoint ← {megatron_dir}/weights")
    state = dist_checkpointing.load(model.sharded_state_dict(), str(megatron_dir / "weights"))
    model.load_state_dict(state)
    return bridge, model


def megatron_to_hf(megatron_dir: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """Convert a checkpoint written by `hf_to_megatron` back into an HF checkpoint at `out_dir`."""
    bridge, model = load_megatron_checkpoint(megatron_dir)
    with atomic_output_dir(out_dir, overwrite) as tmp:
        bridge.save_hf_pretrained([model], tmp)
        for name in HF_SIDE_FILES:  # tokenizer files travel with the Megatron checkpoint
            src = Path(megatron_dir) / "hf" / name
            if src.is_file() and not (tmp / name).exists():
                shutil.copy2(src, tmp / name)
    return Path(out_dir)
