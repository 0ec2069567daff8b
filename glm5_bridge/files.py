"""Files on disk, safely: writes that readers see whole or not at all, and checkpoint reads that
run no code.

Writes go to a temporary name beside the target (`.{name}.tmp-{pid}`), are fsynced and renamed into
place; a process killed mid-write leaves only that temporary, which `remove_abandoned` deletes once
its pid is gone. Every output folder passes one guard first (`check_output`): it may not be, contain
or lie inside what the command reads, and an existing one is replaced only with `overwrite` and only
if this project wrote it (it carries `OUTPUT_MARKER`). Reads of a Megatron distributed checkpoint
refuse any pickle that would import more than the checkpoint's own metadata types
(`no_arbitrary_unpickling`).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path


OUTPUT_MARKER = ".glm5-bridge-output"  # in every folder written through atomic_output_dir


class OutputRefused(FileExistsError):
    """An output folder that may not be written (it overlaps an input, or is not ours to replace)."""


def check_output(target: str | os.PathLike, reads=(), overwrite: bool = False, kind: str = "output") -> Path:
    """The guard every writer runs before its (long) work and again when it starts writing.
    Refuses a `target` that is, contains or lies inside one of `reads` (the command's inputs: a
    checkpoint, a run folder); one that exists as a file; and an existing non-empty folder unless
    `overwrite` is set and the folder carries OUTPUT_MARKER of the same `kind` ("output": a
    checkpoint or export, replaced whole; "run": a training run folder, written into). A folder of
    someone else's, or a run folder where an output goes, is never deleted. An empty folder is as
    good as none. Returns `target`."""
    out = Path(target).resolve()
    for source in reads:
        src = Path(source).resolve()
        if out == src or out in src.parents or src in out.parents:
            how = "is" if out == src else "contains" if out in src.parents else "lies inside"
            raise OutputRefused(f"{target}: {how} {src}, which this command reads; choose another output folder")
    if not out.exists():
        return Path(target)
    if not out.is_dir():
        raise OutputRefused(f"{target}: exists and is not a folder")
    if not any(out.iterdir()):
        return Path(target)
    if not overwrite:
        raise OutputRefused(f"{target}: already exists (pass --overwrite / overwrite=True to replace it)")
    found = output_kind(out)
    if found is None:
        raise OutputRefused(f"{target}: not written by glm5-bridge (no {OUTPUT_MARKER}), so it is neither replaced "
                            f"nor written into; remove it yourself or choose another folder")
    if found != kind:
        raise OutputRefused(f"{target}: a glm5-bridge {_KIND_NAMES.get(found, found)}, not "
                            f"{_KIND_NAMES.get(kind, kind)}; choose another folder")
    return Path(target)


_KIND_NAMES = {"output": "checkpoint or export folder", "run": "training run folder"}


def output_kind(folder: str | os.PathLike) -> str | None:
    """The kind in `folder`'s OUTPUT_MARKER ("output", "run"), or None when it has none."""
    marker = Path(folder) / OUTPUT_MARKER
    if not marker.is_file():
        return None
    words = marker.read_text(errors="replace").split()
    return words[1] if len(words) > 1 and words[0] == "glm5-bridge" else None


def mark_output(folder: str | os.PathLike, kind: str = "output") -> None:
    from glm5_bridge import __version__

    (Path(folder) / OUTPUT_MARKER).write_text(f"glm5-bridge {kind} {__version__}\n")


@contextmanager
def atomic_output_dir(target: str | os.PathLike, overwrite: bool = False, reads=(), collective: bool = True):
    """Yield a fresh temporary folder beside `target`; on success mark it as ours (OUTPUT_MARKER),
    fsync its files and folders and rename it to `target`. `check_output(target, reads, overwrite)`
    decides first whether `target` may be written. On any error the temporary folder is removed
    and `target` is left as it was. A process killed inside leaves `.{name}.tmp-{pid}` behind:
    `remove_abandoned` cleans it. Under torch.distributed with several ranks every rank writes into
    the same temporary folder (a distributed checkpoint): rank 0 makes and names it, and renames it
    once every rank is done and none failed (`collective=False`: this process alone writes it)."""
    import torch.distributed as dist

    if collective and dist.is_initialized() and dist.get_world_size() > 1:
        with _atomic_output_dir_all_ranks(Path(target), overwrite, reads) as tmp:
            yield tmp
        return
    tmp = _fresh_tmp(Path(target), overwrite, reads)
    try:
        yield tmp
        _commit(tmp, Path(target))
    except BaseException as e:
        failure = write_failure(target, e)
        shutil.rmtree(tmp, ignore_errors=True)
        if failure is not None:
            raise failure from e
        raise


def _fresh_tmp(target: Path, overwrite: bool, reads) -> Path:
    check_output(target, reads, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(target.parent, target.name)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _commit(tmp: Path, target: Path) -> None:
    """Mark `tmp` as ours, fsync everything under it, then put it in `target`'s place."""
    mark_output(tmp)
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
def _atomic_output_dir_all_ranks(target: Path, overwrite: bool, reads):
    import torch
    import torch.distributed as dist

    box = [None, None]  # (temporary folder, error) from rank 0
    if dist.get_rank() == 0:
        try:
            box[0] = str(_fresh_tmp(target, overwrite, reads))
        except OSError as e:
            box[1] = e
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise box[1]
    tmp = Path(box[0])
    failed = None
    try:
        yield tmp
    except BaseException as e:
        failed = write_failure(target, e) or e
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


# Bytes left on the target's filesystem under which a failed write is reported as a full disk:
# torch.save and dist_checkpointing report a short write without an errno ("unexpected pos ...").
_NEARLY_FULL = 16 * 2**20


def write_failure(target: str | os.PathLike, error: BaseException) -> OSError | None:
    """A one-line OSError naming `target` for a write that failed on a full disk (safetensors raises
    SafetensorError "... os error 28", torch a RuntimeError without errno, dist_checkpointing a
    CheckpointException around a worker failure; none names the target), or a CheckpointException
    made one line; None for any other error (it is raised as it is)."""
    io_like = isinstance(error, (OSError, RuntimeError)) or type(error).__name__ in ("CheckpointException",
                                                                                     "SafetensorError")
    if not io_like:
        return None
    folder = Path(target).resolve().parent
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    text = str(error)
    if (getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in text or "os error 28" in text
            or free < _NEARLY_FULL):
        full = OSError(f"{target}: no space left on device ({free / 2**20:.1f} MiB free on {_mount_point(folder)}); "
                       "nothing was written")
        full.errno = errno.ENOSPC
        return full
    if type(error).__name__ == "CheckpointException":  # a BaseException with a multi-line report
        last = [line.strip() for line in text.splitlines() if line.strip()][-1:] or ["no detail"]
        return OSError(f"{target}: the distributed checkpoint could not be written ({last[0]})")
    return None


def _mount_point(path: Path) -> Path:
    while not os.path.ismount(path):
        path = path.parent
    return path


@contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb"):
    """A file opened for writing under a temporary name beside `path`, fsynced and renamed onto
    `path` when the block ends: readers see the old content or the new, never a part. An exception
    in the block removes the temporary and leaves `path` as it was."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write a small text file so that readers see the old content or the new, never a part."""
    with atomic_file(path, "w") as f:
        f.write(text)
    return Path(path)


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
