"""Files on disk, safely: writes that readers see whole or not at all, and checkpoint reads that
run no code.

Writes go to a temporary name beside the target (`.{name}.tmp-{pid}`), are fsynced and renamed into
place; a process killed mid-write leaves only that temporary, which `remove_abandoned` deletes once
its pid is gone. Reads of a Megatron distributed checkpoint refuse any pickle that would import
more than the checkpoint's own metadata types (`no_arbitrary_unpickling`).
"""

from __future__ import annotations

import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_output_dir(target: str | os.PathLike, overwrite: bool = False):
    """Yield a fresh temporary folder beside `target`; on success fsync its files and folders and
    rename it to `target`. On any error the temporary folder is removed and `target` is left as it
    was. A process killed inside leaves `.{name}.tmp-{pid}` behind: `remove_abandoned` cleans it.
    Under torch.distributed with several ranks every rank writes into the same temporary folder (a
    distributed checkpoint): rank 0 makes and names it, and renames it once every rank is done and
    none failed."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        with _atomic_output_dir_all_ranks(Path(target), overwrite) as tmp:
            yield tmp
        return
    tmp = _fresh_tmp(Path(target), overwrite)
    try:
        yield tmp
        _commit(tmp, Path(target))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fresh_tmp(target: Path, overwrite: bool) -> Path:
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target}: already exists (pass overwrite=True / --overwrite to replace it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(target.parent, target.name)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _commit(tmp: Path, target: Path) -> None:
    """fsync everything under `tmp`, then put it in `target`'s place."""
    for root, dirs, files in os.walk(tmp, topdown=False):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(root)
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old)
    else:
        tmp.rename(target)
    fsync_dir(target.parent)


@contextmanager
def _atomic_output_dir_all_ranks(target: Path, overwrite: bool):
    import torch
    import torch.distributed as dist

    box = [None, None]  # (temporary folder, error message) from rank 0
    if dist.get_rank() == 0:
        try:
            box[0] = str(_fresh_tmp(target, overwrite))
        except OSError as e:
            box[1] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise (FileExistsError if box[1].startswith("FileExistsError") else OSError)(box[1].split(": ", 1)[1])
    tmp = Path(box[0])
    failed = None
    try:
        yield tmp
    except BaseException as e:
        failed = e
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([0 if failed is None else 1], device=device)
    dist.all_reduce(flag)  # how many ranks failed
    error = None
    if dist.get_rank() == 0:
        try:
            if flag.item():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                _commit(tmp, target)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = f"{e}"
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if failed is not None:
        raise failed
    if flag.item():
        raise RuntimeError(f"{target}: not written: another rank failed while writing it")
    if box[0] is not None:
        raise OSError(box[0])


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write a small text file so that readers see the old content or the new, never a part."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_ABANDONED = re.compile(r"^\.(.+)\.(tmp|old)-(\d+)(-[0-9a-f]+)?$")


def remove_abandoned(folder: str | os.PathLike, name: str | None = None) -> list[str]:
    """Remove what `atomic_output_dir`, `atomic_write_text` and the exports left in `folder` when
    their process died: `.{name}.tmp-{pid}[-{hex}]` / `.{name}.old-{pid}[-{hex}]` of a pid that no
    longer runs (only for target `name` when given). Returns the names removed."""
    folder, removed = Path(folder), []
    if not folder.is_dir():
        return removed
    for entry in sorted(folder.iterdir()):
        match = _ABANDONED.match(entry.name)
        if match is None or (name is not None and match.group(1) != name) or _alive(int(match.group(3))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry.name)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# What torch's distributed-checkpoint metadata (`weights/.metadata`, a pickle) may name: its own
# dataclasses and enums, megatron's sharded-tensor descriptions, torch dtypes and sizes, containers.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                                             "LoadPlan", "ReadItem", "LoadItemType"},
    "megatron.core.dist_checkpointing.mapping": {"ShardedTensor", "ShardedObject"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "tuple", "list", "dict", "bytearray"},
    "copyreg": {"_reconstructor"},
    "_codecs": {"encode"},
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file that would need arbitrary code to load."""


@contextmanager
def no_arbitrary_unpickling(where: str | os.PathLike):
    """While loading a Megatron distributed checkpoint, every pickle it holds is read without
    running code: the metadata file through an unpickler that resolves only `_METADATA_GLOBALS`,
    the non-tensor items (`_extra_state`, common state) with `torch.load(weights_only=True)`
    where torch would unpickle freely. A checkpoint is data from disk. Yields
    the list of refusals and read errors (torch wraps reader errors, so the caller re-raises the
    first as one line)."""
    import io
    import pickle

    import torch
    from torch.distributed.checkpoint import default_planner, filesystem

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            allowed = name in _METADATA_GLOBALS.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
            if not allowed:
                refused.append(f"{where}/.metadata: refusing to unpickle {module}.{name} "
                               "(not a distributed-checkpoint metadata type)")
                raise UnsafeCheckpointError(refused[-1])
            return super().find_class(module, name)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:  # DefaultLoadPlanner.load_bytes, weights only
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            refused.append(f"{where}: item {read_item.dest_index.fqn} is unreadable ({torch_load_error(e)})")
            raise UnsafeCheckpointError(refused[-1]) from None
        if self.flatten_state_dict:
            default_planner.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

    shim = type("RestrictedPickle", (), {"load": staticmethod(lambda f, **kw: Unpickler(f, **kw).load()),
                                          "dump": staticmethod(pickle.dump), "dumps": staticmethod(pickle.dumps),
                                          "HIGHEST_PROTOCOL": pickle.HIGHEST_PROTOCOL})
    saved = filesystem.pickle, default_planner.DefaultLoadPlanner.load_bytes
    filesystem.pickle, default_planner.DefaultLoadPlanner.load_bytes = shim, load_bytes
    refused: list[str] = []
    try:
        yield refused
    finally:
        filesystem.pickle, default_planner.DefaultLoadPlanner.load_bytes = saved


def torch_load_error(error: Exception) -> str:
    """The informative part of a torch.load error, on one line (weights-only refusals bury it
    mid-message, after advice to retry without them)."""
    text = str(error)
    if text.startswith("Weights only load failed"):
        detail = text.split("\n", 1)[1] if "\n" in text else ""
        detail = detail.split("WeightsUnpickler error:", 1)[-1].split("Check the documentation", 1)[0]
        return "refused by the weights-only unpickler: " + (" ".join(detail.split()) or "unsupported content")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
