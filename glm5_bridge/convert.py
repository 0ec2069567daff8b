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
from pathlib import Path

from glm5_bridge.files import UnsafeCheckpointError, atomic_output_dir, check_output, no_arbitrary_unpickling

HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja")
MARKER = "glm5_bridge.json"


def hf_to_megatron(hf_path: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False,
                   **provider_overrides) -> Path:
    """Convert an HF GLM-5.x checkpoint into a Megatron distributed checkpoint at `out_dir`."""
    import torch
    from megatron.core import dist_checkpointing

    from glm5_bridge.model.bridge import build_megatron_model
    from glm5_bridge.progress import folder_progress

    hf_path = Path(hf_path)
    check_output(out_dir, [hf_path], overwrite)  # before the (long) load, not after
    _, model = build_megatron_model(hf_path, **provider_overrides)
    with atomic_output_dir(out_dir, overwrite, reads=[hf_path]) as tmp:
        (tmp / "weights").mkdir()
        size = sum(t.numel() * t.element_size() for t in model.state_dict().values() if isinstance(t, torch.Tensor))
        with folder_progress(tmp / "weights", size, f"saving Megatron checkpoint → {out_dir}/weights"):
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

    from glm5_bridge.model.bridge import build_megatron_model

    megatron_dir = Path(megatron_dir)
    if not (megatron_dir / MARKER).is_file():
        raise FileNotFoundError(f"{megatron_dir}: not a glm5-bridge Megatron checkpoint (no {MARKER})")
    bridge, model = build_megatron_model(megatron_dir / "hf", load_weights=False, **provider_overrides)
    print(f"loading Megatron distributed checkpoint ← {megatron_dir}/weights")
    refused: list[str] = []
    try:
        with no_arbitrary_unpickling(megatron_dir / "weights") as refused:
            state = dist_checkpointing.load(model.sharded_state_dict(), str(megatron_dir / "weights"))
    except BaseException as e:  # torch wraps reader errors in CheckpointException (a BaseException)
        if refused:
            raise UnsafeCheckpointError(refused[0]) from None
        if type(e).__name__ != "CheckpointException":
            raise
        last = [line for line in str(e).splitlines() if line.strip()][-1]
        raise ValueError(f"{megatron_dir}/weights: unreadable distributed checkpoint, truncated or corrupt "
                         f"({last.strip()})") from None
    model.load_state_dict(state)
    return bridge, model


def megatron_to_hf(megatron_dir: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """Convert a checkpoint written by `hf_to_megatron` back into an HF checkpoint at `out_dir`."""
    check_output(out_dir, [megatron_dir], overwrite)
    bridge, model = load_megatron_checkpoint(megatron_dir)
    with atomic_output_dir(out_dir, overwrite, reads=[megatron_dir]) as tmp:
        bridge.save_hf_pretrained([model], tmp)
        for name in HF_SIDE_FILES:  # tokenizer files travel with the Megatron checkpoint
            src = Path(megatron_dir) / "hf" / name
            if src.is_file() and not (tmp / name).exists():
                shutil.copy2(src, tmp / name)
    return Path(out_dir)
