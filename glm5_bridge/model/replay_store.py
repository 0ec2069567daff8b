"""A compact, exact on-disk form of indexer top-k for replay (R3), read one layer and row block at
a time.

sglang sends every decoder layer's top-k as int32: 78 × 2048 × 4 B ≈ 639 KB per token for
GLM-5.2. Here a request's top-k is kept per computing layer (IndexShare copies are not stored) in
blocks of `BLOCK_ROWS` query rows. Attention does not depend on slot order, so a row is a set of
key positions, and a row is coded as its difference from the row before it: consecutive queries
select mostly the same keys, and before position `index_topk` a row is its predecessor plus one key.
A block holds, per row, the number of keys that enter or leave (the symmetric difference of the two
rows' key sets) and their positions as deltas, both as LEB128 varints, then deflated (zlib level 1);
coding and decoding work on sorted arrays, O(index_topk) a row whatever the sequence length.
Decoding gives each row's keys in ascending order, −1 padded to `index_topk`: the same set.

File layout: the blocks back to back, then a JSON index (per request: rows, index_topk, and per
computing-layer slot the blocks' (first row, rows, offset, length)), then the index's byte length
(8 bytes, little endian) and MAGIC.

    with ReplayStoreWriter(path) as w:
        w.add_rows("req-0", slot=0, first_row=0, rows=block)    # int32 [n, index_topk], −1 padded
    store = ReplayStore(path)
    store.layer("req-0", 0)                                      # int32 tensor [rows, index_topk]
"""

from __future__ import annotations

import json
import os
import zlib
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch

from glm5_bridge.files import atomic_file

MAGIC = b"GLM5R3v1"
BLOCK_ROWS = 64  # rows per block: the unit a reader decodes


# ------------------------------------------------------------------------------- varints (LEB128)

def encode_varints(values: np.ndarray) -> bytes:
    """Non-negative integers < 2**35 as LEB128 (7 bits a byte, high bit = more bytes follow)."""
    v = np.asarray(values, dtype=np.uint64)
    nbytes = np.ones(v.shape, dtype=np.int64)
    for bits in (7, 14, 21, 28):
        nbytes += v >= (1 << bits)
    ends = np.cumsum(nbytes)
    out = np.zeros(int(ends[-1]) if v.size else 0, dtype=np.uint8)
    starts = ends - nbytes
    for j in range(5):
        has = nbytes > j
        more = (nbytes[has] > j + 1).astype(np.uint8) << 7
        out[starts[has] + j] = ((v[has] >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8) | more
    return out.tobytes()


def decode_varints(data: bytes | np.ndarray, count: int) -> tuple[np.ndarray, int]:
    """The first `count` LEB128 values of `data` (uint64) and the bytes they took."""
    b = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else data
    if count == 0:
        return np.zeros(0, dtype=np.uint64), 0
    last = np.flatnonzero(b < 0x80)[:count]
    if last.size < count:
        raise ValueError(f"replay store: {count} varints expected, {last.size} found")
    used = int(last[-1]) + 1
    starts = np.concatenate([[0], last[:-1] + 1])
    place = np.arange(used) - np.repeat(starts, last - starts + 1)
    parts = (b[:used] & 0x7F).astype(np.uint64) << (np.uint64(7) * place.astype(np.uint64))
    return np.add.reduceat(parts, starts), used


# ------------------------------------------------------------------------------------ a row block

def encode_block(rows: np.ndarray) -> bytes:
    """int32 [n, index_topk] key positions (−1 = unused; a row's keys distinct) → bytes. The row
    before the block counts as empty, so a block decodes on its own."""
    n = rows.shape[0]
    ordered = np.sort(rows, axis=1)  # −1 first, then the keys ascending
    counts, changes, previous = np.zeros(n, dtype=np.int64), [], np.zeros(0, dtype=ordered.dtype)
    for r in range(n):
        current = ordered[r][ordered[r] >= 0]
        toggled = np.setxor1d(previous, current, assume_unique=True)  # keys entering or leaving, ascending
        counts[r] = toggled.size
        changes.append(np.diff(toggled, prepend=0))  # the first change of a row is absolute
        previous = current
    deltas = np.concatenate(changes) if changes else np.zeros(0, dtype=np.int64)
    return zlib.compress(encode_varints(counts) + encode_varints(deltas), 1)


def decode_block(blob: bytes, n: int, index_topk: int) -> np.ndarray:
    """encode_block's rows: int32 [n, index_topk], each row's keys ascending, then −1. Each row is
    the row before it with its changes applied to a sorted array: O(index_topk) a row, whatever
    the sequence length."""
    raw = np.frombuffer(zlib.decompress(blob), dtype=np.uint8)
    counts, used = decode_varints(raw, n)
    counts = counts.astype(np.int64)
    deltas, _ = decode_varints(raw[used:], int(counts.sum()))
    before = np.concatenate([[0], np.cumsum(deltas.astype(np.int64))])  # deltas restart at each row
    ends = np.cumsum(counts)
    keys = before[1:] - np.repeat(before[ends - counts], counts)
    out = np.full((n, index_topk), -1, dtype=np.int32)
    current = np.zeros(0, dtype=np.int64)
    for r in range(n):
        changes = keys[ends[r] - counts[r]:ends[r]]
        if changes.size:
            at = np.searchsorted(current, changes)
            present = at < current.size
            present[present] = current[at[present]] == changes[present]
            kept = np.delete(current, at[present])
            entering = changes[~present]
            current = np.insert(kept, np.searchsorted(kept, entering), entering)
        if current.size > index_topk:
            raise ValueError(f"replay store: a row holds {current.size} keys, more than index_topk {index_topk}")
        out[r, :current.size] = current
    return out


# ------------------------------------------------------------------------------------------ file

class ReplayStoreWriter:
    """Appends row blocks; the index is written at close. The file is written under a temporary
    name and renamed at close (files.atomic_file), so a reader never sees a partial store."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._stack = ExitStack()
        self._f = self._stack.enter_context(atomic_file(self.path))
        self._offset = 0
        self._index: dict[str, dict] = {}

    def add_rows(self, request: str, slot: int, first_row: int, rows: np.ndarray | torch.Tensor) -> None:
        rows = rows.numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
        entry = self._index.setdefault(str(request), {"index_topk": int(rows.shape[1]), "rows": 0, "layers": {}})
        if rows.shape[1] != entry["index_topk"]:
            raise ValueError(f"replay store: {request}: index_topk {rows.shape[1]}, earlier {entry['index_topk']}")
        for start in range(0, rows.shape[0], BLOCK_ROWS):
            part = rows[start:start + BLOCK_ROWS]
            blob = encode_block(part)
            self._f.write(blob)
            entry["layers"].setdefault(str(slot), []).append([first_row + start, part.shape[0], self._offset, len(blob)])
            self._offset += len(blob)
        entry["rows"] = max(entry["rows"], first_row + rows.shape[0])

    def close(self) -> Path:
        index = json.dumps(self._index).encode()
        self._f.write(index + len(index).to_bytes(8, "little") + MAGIC)
        self._stack.close()  # fsync, rename into place
        return self.path

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if kind is None:
            self.close()
            return False
        return self._stack.__exit__(kind, error, tb)  # the temporary is removed, the error goes on


class ReplayStore:
    """Reads a store: a layer of a request (or some of its rows) at a time, from its blocks only."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            f.seek(-16, os.SEEK_END)
            tail = f.read(16)
            if tail[8:] != MAGIC:
                raise ValueError(f"{self.path}: not a glm5-bridge replay store (no {MAGIC!r} at its end)")
            size = int.from_bytes(tail[:8], "little")
            f.seek(-16 - size, os.SEEK_END)
            self.index = json.loads(f.read(size))

    def requests(self) -> list[str]:
        return list(self.index)

    def shape(self, request: str) -> tuple[int, int, int]:
        entry = self.index[request]
        return entry["rows"], len(entry["layers"]), entry["index_topk"]

    def layer(self, request: str, slot: int, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """int32 [rows, index_topk] of the slot-th computing layer; `rows=(a, b)`: rows a … b−1 only
        (the blocks that hold them are read, nothing else)."""
        entry = self.index[request]
        a, b = rows or (0, entry["rows"])
        out = np.full((b - a, entry["index_topk"]), -1, dtype=np.int32)
        with open(self.path, "rb") as f:
            for first, n, offset, length in entry["layers"][str(slot)]:
                if first + n <= a or first >= b:
                    continue
                f.seek(offset)
                block = decode_block(f.read(length), n, entry["index_topk"])
                lo, hi = max(a, first), min(b, first + n)
                out[lo - a:hi - a] = block[lo - first:hi - first]
        return torch.from_numpy(out)
