"""R3 replay payloads of one request: the rollout engine's indexer top-k and routed experts, their
sglang wire form, this project's on-disk form, and the checks both pass through.

sglang wire form (a generate response's `meta_info`; docs/replay.md has the server and request flags):
  indexer_topk              base64 of int32 little-endian [len(tokens) − 1, layers, index_topk]. Row i
                            is the query at position i (the last token is never fed, so it has no row).
                            layers = every decoder layer (num_hidden_layers): an IndexShare "shared"
                            layer's slot holds a copy of its source layer's top-k; the MTP layer is not
                            included. −1 = unused slot. Values are request-local key positions in the
                            sglang build miles uses (sglang PR 26684); the 0.5.23 release sends
                            KV-cache coordinates instead, which are refused (see `RequestTopk.check`).
  indexer_topk_num_layers   the layer count; only miles' build sends it.
  routed_experts            base64 of int32 [len(tokens) − 1 − start, layers, num_experts_per_tok],
                            layers = every decoder layer (dense layers' rows are zeros) or the MoE
                            layers only; logical expert ids.
  routed_experts_start_len  `start` (absent: 0): the rows begin at position `start`.

Decoding accepts every decoder layer (sglang's form: a shared layer's slot must equal its source's)
or the computing layers only (the compact form this project once wrote). The layer count comes from
`indexer_topk_num_layers` when present, else from the byte length, len(tokens) − 1 rows and
index_topk. Encoding writes sglang's form with `indexer_topk_num_layers`, so any reader that follows
sglang (miles included) reads it.

In memory a `RequestTopk` holds the computing layers only, int32 [rows, computing layers,
index_topk]: the slots a model's replay looks up. Routed experts decode to int32 [len(tokens) − 1,
MoE layers, top-k] with −1 rows where the payload has none (the router then chooses itself).
"""

from __future__ import annotations

import base64
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

FILE_FORMAT = "glm5-indexer-topk"
SGLANG_BUILD = ("sglang's 0.5.23 release returns KV-cache coordinates; R3 needs request-local positions, "
                "as the sglang build miles uses returns them (sglang PR 26684, see docs/replay.md)")


@dataclass(frozen=True)
class ReplayLayout:
    """What one model's payloads look like: its decoder layers' IndexShare schedule and widths."""
    indexer_types: tuple[str, ...]  # per decoder layer: "full" (runs its indexer) or "shared"
    index_topk: int
    moe_topk: int = 0
    num_experts: int = 0
    first_k_dense: int = 0

    @classmethod
    def from_hf_config(cls, hf_config) -> "ReplayLayout":
        from glm5_bridge.model.config import indexer_types

        return cls(tuple(indexer_types(hf_config)), int(hf_config.index_topk), int(hf_config.num_experts_per_tok),
                   int(hf_config.n_routed_experts), int(hf_config.first_k_dense_replace))

    @classmethod
    def from_model_config(cls, config) -> "ReplayLayout":
        """From a megatron TransformerConfig built by the GLM-5 bridge."""
        freq = config.moe_layer_freq
        dense = freq.index(1) if isinstance(freq, list) and 1 in freq else 0
        return cls(tuple(config.dsa_indexer_types), int(config.dsa_indexer_topk), int(config.moe_router_topk or 0),
                   int(config.num_moe_experts or 0), dense)

    @property
    def num_layers(self) -> int:
        return len(self.indexer_types)

    @property
    def computing(self) -> list[int]:
        """Decoder layers (0-based) that run their indexer: the payload slots a model replays."""
        return [i for i, t in enumerate(self.indexer_types) if t == "full"]

    @property
    def sources(self) -> list[int]:
        """Per decoder layer, the layer whose top-k it attends with (itself when computing)."""
        from glm5_bridge.model.config import topk_source_layers

        return topk_source_layers(list(self.indexer_types))


def _request(sample_id) -> str:
    return "request" if sample_id is None else f"request {sample_id!r}"


def _int32_rows(encoded: str, what: str, name: str) -> torch.Tensor:
    """Flat int32 view of a base64 payload (little-endian, zero-copy where possible)."""
    if sys.byteorder != "little":
        raise NotImplementedError("replay payloads are little-endian int32; this host is big-endian")
    if not isinstance(encoded, str):
        raise ValueError(f"{name}: {what} must be a base64 string, got {type(encoded).__name__}")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except ValueError as e:
        raise ValueError(f"{name}: {what} is not valid base64 ({e})") from None
    if len(raw) % 4:
        raise ValueError(f"{name}: {what} has {len(raw)} bytes, not a whole number of int32 values")
    if not raw:
        return torch.empty(0, dtype=torch.int32)
    with warnings.catch_warnings():  # read-only bytes: a zero-copy view we never write to
        warnings.simplefilter("ignore")
        return torch.frombuffer(raw, dtype=torch.int32)


def _num_tokens(meta_info: dict, num_tokens: int | None) -> int | None:
    if num_tokens is None and "prompt_tokens" in meta_info and "completion_tokens" in meta_info:
        num_tokens = int(meta_info["prompt_tokens"]) + int(meta_info["completion_tokens"])
    return num_tokens


class RequestTopk:
    """Indexer top-k of one request: int32 [rows, computing layers, index_topk], request-local key
    positions, −1 padded; row i is the query at position i."""

    def __init__(self, topk: torch.Tensor, sample_id: str | None = None):
        if topk.dim() != 3 or topk.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"indexer replay: {_request(sample_id)}: top-k must be an int tensor "
                             f"[rows, computing layers, index_topk], got {topk.dtype} {tuple(topk.shape)}")
        self._topk = topk.to("cpu", torch.int32)
        self._path = None
        self._read_layer = None  # a compact replay store's reader (from_store)
        self.shape = tuple(self._topk.shape)
        self.sample_id = sample_id

    rows = property(lambda self: self.shape[0])
    num_layers = property(lambda self: self.shape[1])
    index_topk = property(lambda self: self.shape[2])

    def layer(self, slot: int) -> torch.Tensor:
        """[rows, index_topk] int32 of the slot-th computing layer (read from disk if lazy)."""
        if self._read_layer is not None:
            return self._read_layer(slot)
        if self._path is None:
            return self._topk[:, slot]
        from safetensors import safe_open

        with safe_open(self._path, "pt") as f:
            return f.get_slice("indexer_topk")[:, slot, :]

    def with_window_rows(self, extra: int) -> "RequestTopk":
        """This request followed by `extra` rows (positions rows … rows + extra − 1) holding the
        window of the index_topk most recent keys, self included: what replay gives rows a payload
        does not cover, for pads a layout adds after a sequence. Lazy: a layer is built when read."""
        rows, k = self.rows, self.index_topk
        window = torch.arange(rows, rows + extra)[:, None] - torch.arange(k)
        window = torch.where(window >= 0, window, -1).to(torch.int32)
        out = RequestTopk(torch.empty(0, 0, 0, dtype=torch.int32), self.sample_id)
        out.shape = (rows + extra, self.num_layers, k)
        out._read_layer = lambda slot: torch.cat([self.layer(slot), window])
        return out

    def tensor(self) -> torch.Tensor:
        lazy = self._path is not None or self._read_layer is not None
        return torch.stack([self.layer(j) for j in range(self.num_layers)], 1) if lazy else self._topk

    def check(self, layout: ReplayLayout | None = None, first_row: int = 0) -> "RequestTopk":
        """Every slot −1 or a key position at or before its row's query, no key twice in a row; one
        line naming the request and layer otherwise. A key past its query is what KV-cache
        coordinates look like, and the message says so. `first_row`: the position of row 0 (a block
        of a longer request). Returns self."""
        layers = layout.computing if layout is not None else list(range(self.num_layers))
        pos = torch.arange(first_row, first_row + self.rows)[:, None]
        for slot, layer in enumerate(layers):
            t = self.layer(slot)
            where = f"indexer replay: {_request(self.sample_id)}, model.layers.{layer}"
            below = t < -1
            if below.any():
                r = int(below.any(1).nonzero()[0, 0])
                raise ValueError(f"{where}: row {first_row + r} selects key {int(t[r][below[r]][0])}, below −1")
            late = t > pos
            if late.any():
                r = int(late.any(1).nonzero()[0, 0])
                raise ValueError(f"{where}: row {first_row + r} selects key {int(t[r][late[r]][0])}, after its own "
                                 f"position {first_row + r}: this looks like KV-cache coordinates, not positions. "
                                 f"{SGLANG_BUILD}")
            ordered = t.sort(1).values
            twice = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
            if twice.any():
                r = int(twice.any(1).nonzero()[0, 0])
                raise ValueError(f"{where}: row {first_row + r} selects key {int(ordered[r, 1:][twice[r]][0])} twice")
        return self

    # --- sglang ---
    @classmethod
    def from_sglang(cls, meta_info: dict, layout: ReplayLayout, num_tokens: int | None = None,
                    sample_id: str | None = None, shared_mismatch: str = "error") -> "RequestTopk":
        """Decode and check `meta_info.indexer_topk` for a model of this layout. num_tokens =
        len(tokens) (else prompt_tokens + completion_tokens from meta_info). shared_mismatch:
        "error" or "warn" when a shared layer's slot differs from its source's."""
        if shared_mismatch not in ("error", "warn"):
            raise ValueError(f"shared_mismatch must be 'error' or 'warn', got {shared_mismatch!r}")
        name = f"indexer replay: {_request(sample_id)}"
        flat = _int32_rows(meta_info["indexer_topk"], "indexer_topk", name)
        num_tokens, k = _num_tokens(meta_info, num_tokens), layout.index_topk
        all_layers, computing = layout.num_layers, len(layout.computing)
        given = meta_info.get("indexer_topk_num_layers")
        if given is not None:
            layers = int(given)
            if layers not in (all_layers, computing):
                raise ValueError(f"{name}: indexer_topk_num_layers is {layers}; the model has {all_layers} decoder "
                                 f"layers, {computing} of them computing top-k")
            rows = flat.numel() // (layers * k) if num_tokens is None else num_tokens - 1
            fits = flat.numel() == rows * layers * k
        else:
            if num_tokens is None:
                raise ValueError(f"{name}: no indexer_topk_num_layers and no token count: pass num_tokens")
            rows = num_tokens - 1
            fits = rows > 0 and flat.numel() % (rows * k) == 0 and flat.numel() // (rows * k) in (all_layers, computing)
            layers = flat.numel() // (rows * k) if fits else None
        if not fits:
            raise ValueError(f"{name}: indexer_topk holds {flat.numel()} int32, which fits neither {all_layers} decoder "
                             f"layers nor {computing} computing layers × (len(tokens) − 1 = {rows}) rows × index_topk {k}")
        t = flat.view(rows, layers, k)
        if layers == all_layers and layers != computing:
            check_shared_copies(t, layout, name, shared_mismatch)
            t = t[:, layout.computing]
        return cls(t, sample_id).check(layout)

    def to_sglang(self, layout: ReplayLayout) -> dict:
        """sglang's form: one slot per decoder layer (shared layers carry their source's copy) and
        `indexer_topk_num_layers`."""
        if self.num_layers != len(layout.computing):
            raise ValueError(f"indexer replay: {_request(self.sample_id)}: {self.num_layers} computing layers, the "
                             f"layout has {len(layout.computing)}")
        slot_of = {layer: j for j, layer in enumerate(layout.computing)}
        t = self.tensor()[:, [slot_of[s] for s in layout.sources]].contiguous()
        return {"indexer_topk": encode_int32(t), "indexer_topk_num_layers": layout.num_layers}

    # --- on disk ---
    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        meta = {"format": FILE_FORMAT, "version": "1", "positions": "request-local"}
        if self.sample_id is not None:
            meta["sample_id"] = str(self.sample_id)
        save_file({"indexer_topk": self.tensor().contiguous()}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, lazy: bool = True) -> "RequestTopk":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FILE_FORMAT or meta.get("version") != "1":
                raise ValueError(f"indexer replay: {path}: not a {FILE_FORMAT} v1 file (metadata {meta})")
            sl = f.get_slice("indexer_topk")
            shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
            topk = None if lazy else f.get_tensor("indexer_topk")
        if dtype != "I32" or len(shape) != 3:
            raise ValueError(f"indexer replay: {path}: indexer_topk must be int32 3-D, got {dtype} {shape}")
        if not lazy:
            return cls(topk, meta.get("sample_id"))
        req = cls(torch.empty(0, 0, 0, dtype=torch.int32), meta.get("sample_id"))
        req._path, req.shape = str(path), shape  # layer() reads from the file from now on
        return req


def from_store(store, request: str, sample_id: str | None = None) -> RequestTopk:
    """A request of a compact replay store (model/replay_store.py) as a RequestTopk whose layers are
    read and decoded one at a time when replay asks for them (each row's keys ascending: the same
    set, another slot order)."""
    req = RequestTopk(torch.empty(0, 0, 0, dtype=torch.int32), sample_id if sample_id is not None else request)
    req.shape = store.shape(request)
    req._read_layer = lambda slot: store.layer(request, slot)
    return req


def check_shared_copies(t: torch.Tensor, layout: ReplayLayout, name: str, on_mismatch: str,
                        first_row: int = 0) -> None:
    """sglang fills a shared layer's slot with its source layer's top-k: any difference means the
    payload's layers are not this model's schedule. `first_row`: the position of t's row 0."""
    for layer, source in enumerate(layout.sources):
        if layer == source:
            continue
        differs = (t[:, layer] != t[:, source]).any(1)
        if differs.any():
            r = first_row + int(differs.nonzero()[0, 0])
            message = (f"{name}, model.layers.{layer}: row {r} differs from the top-k of model.layers.{source}, which "
                       f"this IndexShare layer reuses (is the payload from a model with another indexer schedule?)")
            if on_mismatch == "error":
                raise ValueError(message)
            warnings.warn(message + "; replaying the source layer's top-k", stacklevel=3)


def encode_int32(t: torch.Tensor) -> str:
    """base64 of a tensor's int32 little-endian bytes, row-major (sglang's encoding)."""
    return base64.b64encode(t.to(torch.int32).contiguous().numpy().astype("<i4").tobytes()).decode("ascii")


# --- routed experts --------------------------------------------------------------------------------

def decode_routed_experts(meta_info: dict, layout: ReplayLayout, num_tokens: int,
                          sample_id: str | None = None) -> torch.Tensor:
    """int32 [num_tokens − 1, MoE layers, moe_topk] from `meta_info.routed_experts`; rows before
    `routed_experts_start_len` are −1 (not in the payload: the router chooses). Dense layers' rows
    are dropped unchecked; MoE rows must hold distinct ids in [0, num_experts)."""
    name = f"routing replay: {_request(sample_id)}"
    flat = _int32_rows(meta_info["routed_experts"], "routed_experts", name)
    start = int(meta_info.get("routed_experts_start_len") or 0)
    rows, k = num_tokens - 1, layout.moe_topk
    if not 0 <= start <= rows:
        raise ValueError(f"{name}: routed_experts_start_len {start} is outside [0, len(tokens) − 1 = {rows}]")
    given = rows - start
    moe = layout.num_layers - layout.first_k_dense
    layers = flat.numel() // (given * k) if given and k else 0
    if not given or flat.numel() != given * layers * k or layers not in (layout.num_layers, moe):
        raise ValueError(f"{name}: routed_experts holds {flat.numel()} int32, which fits neither {layout.num_layers} "
                         f"decoder layers nor {moe} MoE layers × (len(tokens) − 1 − start {start} = {given}) rows × "
                         f"num_experts_per_tok {k}")
    experts = flat.view(given, layers, k)
    if layers != moe:
        experts = experts[:, layout.first_k_dense:]
    bad = (experts < 0) | (experts >= layout.num_experts)
    if bad.any():
        r, j, _ = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"{name}, model.layers.{layout.first_k_dense + j}: row {start + r} routes to expert "
                         f"{int(experts[r, j][bad[r, j]][0])}, outside [0, {layout.num_experts})")
    ordered = experts.sort(-1).values
    twice = (ordered[..., 1:] == ordered[..., :-1]).any(-1)
    if twice.any():
        r, j = (int(x) for x in twice.nonzero()[0])
        raise ValueError(f"{name}, model.layers.{layout.first_k_dense + j}: row {start + r} routes to the same "
                         f"expert twice ({experts[r, j].tolist()})")
    out = torch.full((rows, moe, k), -1, dtype=torch.int32)
    out[start:] = experts
    return out


def encode_routed_experts(experts: torch.Tensor, layout: ReplayLayout) -> str:
    """sglang's form of [rows, MoE layers, top-k] (−1 rows must not occur): every decoder layer,
    dense layers' rows zero."""
    if (experts < 0).any():
        raise ValueError("routing replay: cannot encode rows without experts (−1); sglang sends every row")
    dense = torch.zeros(experts.shape[0], layout.first_k_dense, experts.shape[2], dtype=torch.int32)
    return encode_int32(torch.cat([dense, experts.to(torch.int32)], 1))
