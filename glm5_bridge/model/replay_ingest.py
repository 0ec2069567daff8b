"""A rollout file's sglang indexer top-k streamed into a compact replay store (replay_store.py) in
one pass, never holding a whole payload: the base64 string of each line's `indexer_topk` is cut
out of the JSON while it is read, decoded a chunk at a time, checked (key positions, IndexShare
copies) and coded a block of rows at a time; the rest of the line (tokens, masks, rewards, other
meta_info) is parsed as JSON with the payload left out.

    rows = ingest_rollouts("rollouts.jsonl", "run/replay/rollouts.r3", layout)
    rows[i]["meta_info"]["indexer_topk_store"]     # "rollouts.jsonl:1": its request in the store

Host memory: one block of rows of every decoder layer (BLOCK_ROWS × layers × index_topk × 4 B,
41 MB for GLM-5.2) plus the read buffer (1 MiB), whatever the payload's length. The layer count is
`indexer_topk_num_layers` when it comes before the payload in the line, else every decoder layer
(sglang's form); a payload that turns out to have another shape is refused in one line and the
store is not written.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from pathlib import Path

import numpy as np
import torch

from glm5_bridge.model.payload import ReplayLayout, RequestTopk, check_shared_copies
from glm5_bridge.model.replay_store import BLOCK_ROWS, ReplayStoreWriter

CHUNK = 1 << 20
_KEY = re.compile(rb'"indexer_topk"\s*:\s*"')
_LAYERS = re.compile(rb'"indexer_topk_num_layers"\s*:\s*(\d+)')
_HOLD = 64  # bytes kept back in case a key is split across reads


def _events(f):
    """("head", bytes) for the JSON outside the payload, ("payload", bytes) for base64 text,
    ("payload_end", None), ("line_end", None): a JSON-lines file with each indexer_topk string
    streamed. JSON strings hold no raw newline and no unescaped quote, and base64 holds neither."""
    buf, in_payload, eof = b"", False, False
    while True:
        if not eof and len(buf) < CHUNK + _HOLD:
            more = f.read(CHUNK)
            eof, buf = not more, buf + more
        if in_payload:
            end = buf.find(b'"')
            if end >= 0:
                yield "payload", buf[:end]
                yield "payload_end", None
                buf, in_payload = buf[end + 1:], False
            elif eof:
                raise ValueError("indexer_topk: the string is not closed before the end of the file")
            else:
                yield "payload", buf
                buf = b""
            continue
        key, newline = _KEY.search(buf), buf.find(b"\n")
        if key and (newline < 0 or key.start() < newline):
            yield "head", buf[:key.end() - 1]
            buf, in_payload = buf[key.end():], True
        elif newline >= 0:
            yield "head", buf[:newline]
            yield "line_end", None
            buf = buf[newline + 1:]
        elif eof:
            if buf:
                yield "head", buf
                yield "line_end", None
            return
        elif len(buf) > _HOLD:
            yield "head", buf[:-_HOLD]
            buf = buf[-_HOLD:]


class _TopkSink:
    """Base64 text in, checked row blocks of the computing layers out to the store."""

    def __init__(self, writer: ReplayStoreWriter, request: str, layout: ReplayLayout, layers: int,
                 block_rows: int):
        self.writer, self.request, self.layout, self.layers = writer, request, layout, layers
        self.row_bytes = layers * layout.index_topk * 4
        self.block_bytes = block_rows * self.row_bytes
        self.text, self.raw, self.rows = b"", bytearray(), 0
        self.name = f"indexer replay: request {request!r}"
        if layers not in (layout.num_layers, len(layout.computing)):
            raise ValueError(f"{self.name}: indexer_topk_num_layers is {layers}; the model has {layout.num_layers} "
                             f"decoder layers, {len(layout.computing)} of them computing top-k")

    def feed(self, text: bytes) -> None:
        self.text += text.replace(b"\\", b"")  # "\/" is a JSON escape of "/"; base64 holds no backslash
        whole = len(self.text) // 4 * 4
        try:
            self.raw += base64.b64decode(self.text[:whole], validate=True)
        except binascii.Error as e:
            raise ValueError(f"{self.name}: indexer_topk is not valid base64 ({e})") from None
        self.text = self.text[whole:]
        while len(self.raw) >= self.block_bytes:
            self._block(self.block_bytes)

    def finish(self) -> int:
        """Rows stored; the payload must end on a whole row."""
        if self.text:
            raise ValueError(f"{self.name}: indexer_topk is not valid base64 (its length is not a multiple of 4)")
        if len(self.raw) % self.row_bytes:
            raise ValueError(f"{self.name}: indexer_topk does not end on a whole row of {self.layers} layers × "
                             f"index_topk {self.layout.index_topk} int32")
        if self.raw:
            self._block(len(self.raw))
        return self.rows

    def _block(self, nbytes: int) -> None:
        rows = nbytes // self.row_bytes
        block = np.frombuffer(bytes(self.raw[:nbytes]), dtype="<i4").reshape(rows, self.layers, self.layout.index_topk)
        del self.raw[:nbytes]
        t = torch.from_numpy(block.astype(np.int32))
        if self.layers == self.layout.num_layers and self.layers != len(self.layout.computing):
            check_shared_copies(t, self.layout, self.name, "error", first_row=self.rows)
            t = t[:, self.layout.computing]
        RequestTopk(t, self.request).check(self.layout, first_row=self.rows)
        for slot in range(t.shape[1]):
            self.writer.add_rows(self.request, slot, self.rows, t[:, slot].contiguous())
        self.rows += rows


def ingest_rollouts(path: str | Path, store_path: str | Path, layout: ReplayLayout,
                    block_rows: int = BLOCK_ROWS) -> list[dict]:
    """The rows of a rollout file, each line's `meta_info.indexer_topk` replaced by
    `meta_info.indexer_topk_store` (its request id in the store written at `store_path`, named
    "{path}:{line}"). Every payload is checked as RequestTopk.from_sglang checks it; a bad one is
    refused in one line naming the file and line, and then no store is written."""
    path, rows, head, sink, line = Path(path), [], bytearray(), None, 0
    with open(path, "rb") as f, ReplayStoreWriter(store_path) as writer:
        for kind, data in _events(f):
            if kind == "head":
                head += data
            elif kind == "payload":
                if sink is None:
                    given = _LAYERS.search(head)
                    layers = int(given.group(1)) if given else layout.num_layers
                    sink = _TopkSink(writer, f"{path}:{line + 1}", layout, layers, block_rows)
                sink.feed(data)
            elif kind == "payload_end":
                head += b'""'
            else:
                line += 1
                if head.strip():
                    rows.append(_finish_line(bytes(head), sink, f"{path}:{line}"))
                head, sink = bytearray(), None
    return rows


def _finish_line(head: bytes, sink: _TopkSink | None, where: str) -> dict:
    try:
        row = json.loads(head)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    if sink is None:
        return row
    stored, meta = sink.finish(), row.get("meta_info") or {}
    given = meta.get("indexer_topk_num_layers")
    if given is not None and int(given) != sink.layers:
        raise ValueError(f"{where}: indexer_topk_num_layers {given} comes after the payload, which was read as "
                         f"{sink.layers} layers; put it before indexer_topk or send every decoder layer")
    tokens = row.get("tokens")
    if isinstance(tokens, list) and stored != len(tokens) - 1:
        raise ValueError(f"{sink.name}: indexer_topk holds {stored} rows of {sink.layers} layers, "
                         f"len(tokens) − 1 is {len(tokens) - 1}")
    meta.pop("indexer_topk", None)
    meta["indexer_topk_store"] = sink.request
    return row
