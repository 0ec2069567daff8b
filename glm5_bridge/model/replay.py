"""R3 indexer replay: train on exactly the DSA top-k the rollout engine used.

Modes (per forward, decided by the innermost context):
- off (no context): every computing layer runs its lightning indexer, as before.
- record: `with IndexerReplay.recording() as rec:` computes as usual and keeps a CPU int32 copy of
  each computing decoder layer's top-k; `rec.requests()` gives them per sequence,
  `rec.sglang_meta()` in sglang's wire form.
- replay: `with IndexerReplay.replaying(requests):` skips the indexer and uses the given top-k.
  `IndexerReplay.attach(packed_seq_params, requests)` does the same for one micro-batch without a
  context (for megatron's pipeline schedules: call it in forward_step_func).

    layout = ReplayLayout.from_hf_config(hf_config)         # glm5_bridge.model.payload
    with IndexerReplay.replaying([RequestTopk.from_sglang(r["meta_info"], layout, len(tokens)), ...]):
        loss = loss_fn(model(input_ids=..., packed_seq_params=psp, ...))
    loss.backward()

Which layers are in a payload: a `RequestTopk` (glm5_bridge/model/payload.py, which also decodes and
encodes sglang's wire form) holds the computing ("full") decoder layers, in order; slot j is the
(j+1)-th full layer. IndexShare "shared" layers reuse their source layer's top-k, which is the
replayed one. The MTP layer is not in payloads and always computes its own top-k (sglang reports
main-model layers only), in every mode.

Backward: the attention keeps the top-k index tensor in its autograd graph, so backward uses the
forward's indices. Activation recompute reruns the layer and must find the same top-k: the session
is also bound to the micro-batch's carrier object (packed_seq_params, else the attention mask: the
objects IndexShare uses, see attention/index_share.py), and a recompute during backward uses that
binding even after the context has exited; a forward outside any context drops it. Lookups are by
layer and consume nothing, so a second forward in the context replays again. In record mode a
recompute reuses the recorded top-k, and every other forward adds a record. bshd batches have no
per-micro-batch carrier (megatron passes neither mask nor position ids to the core attention):
their recompute outside the context follows the most recent bshd context, so keep backward inside
the context for bshd. `IndexerReplay.mode()` reports the innermost context only.

Payload of one request: int32 [rows, computing layers, index_topk], request-local key positions,
−1 = unused slot. Row i is the top-k of the query at position i. sglang returns rows = len(tokens)
− 1 (the last token was never fed). A micro-batch sequence of n tokens (thd: `cu_seqlens_q`; padding
from `cu_seqlens_q_padded` comes on top) accepts n − 1 <= rows <= padded length. Rows the payload
does not cover (the final position when training on all of `tokens`, and padding) get the window of
the index_topk most recent keys: a valid row that always holds the self key; these positions only
predict past the sample's end, so the choice never enters the loss. Training on tokens[:-1] lines
the rows up exactly.
A row of all −1 means "not reported" (e.g. an engine that skipped a cached prefix): with
on_missing="compute" (default) the layer's own indexer fills those rows; "error" rejects them.

Memory: payloads stay int32 on the host; each layer moves only its own [rows, index_topk] slice
to the device (as int64 flat indices, which its attention keeps for backward, as without replay).
Checks (one line each, naming request and layer): request count, layer count, top-k width, length,
index < −1, index >= request length (rows + 1 = len(tokens)), key outside the causal window,
duplicate key in a row.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from glm5_bridge.model.attention import index_share
from glm5_bridge.model.payload import ReplayLayout, RequestTopk

_ATTR = "_glm5_replay"


@dataclass
class RecordedForward:
    """One micro-batch forward seen by a recording: flat top-k per payload slot (CPU int32)."""
    starts: torch.Tensor
    num_slots: int
    layout: ReplayLayout
    topk: dict[int, torch.Tensor] = field(default_factory=dict)


class Recording:
    def __init__(self):
        self.forwards: list[RecordedForward] = []

    def requests(self, forward: int = -1) -> list[RequestTopk]:
        """A forward's top-k per sequence (rows = its full, padded length), ready to replay/encode."""
        rec = self.forwards[forward]
        missing = sorted(set(range(rec.num_slots)) - set(rec.topk))
        if missing:
            raise ValueError(f"indexer replay: recording lacks indexer layer slots {missing} "
                             "(pipeline stage?); record on every stage")
        flat = torch.stack([rec.topk[j] for j in range(rec.num_slots)], 1)  # [T, L, K]
        seg_starts, counts = torch.unique_consecutive(rec.starts, return_counts=True)
        out = []
        for a, n in zip(seg_starts.tolist(), counts.tolist()):
            part = flat[a:a + n]
            out.append(RequestTopk(torch.where(part >= 0, part - a, -1)))
        return out

    def sglang_meta(self, forward: int = -1) -> list[dict]:
        """A forward's sequences as sglang returns them for requests of exactly these tokens (no
        padding): len(tokens) − 1 rows (the last position is never fed to an engine), one slot per
        decoder layer, `indexer_topk_num_layers`."""
        layout = self.forwards[forward].layout
        return [RequestTopk(r.tensor()[:-1]).to_sglang(layout) for r in self.requests(forward)]


class _Session:
    def __init__(self, mode: str, requests=None, on_missing: str = "compute", explicit: bool = False):
        if on_missing not in ("compute", "error"):
            raise ValueError(f"on_missing must be 'compute' or 'error', got {on_missing!r}")
        if mode == "replay":
            requests = [requests] if isinstance(requests, RequestTopk) else list(requests)
        self.mode, self.requests, self.on_missing, self.explicit = mode, requests, on_missing, explicit
        self.recording = Recording() if mode == "record" else None


@dataclass
class _Bound:
    """A session bound to one micro-batch's carrier object (record: that forward's record)."""
    session: _Session
    recorded: RecordedForward | None = None


# Module global, not thread-local: CUDA backward (and recompute in it) runs on autograd threads.
_active: list[_Session] = []


class IndexerReplay:
    @staticmethod
    @contextmanager
    def recording() -> Iterator[Recording]:
        session = _Session("record")
        _active.append(session)
        try:
            yield session.recording
        finally:
            _active.remove(session)

    @staticmethod
    @contextmanager
    def replaying(requests: RequestTopk | Sequence[RequestTopk], on_missing: str = "compute") -> Iterator[None]:
        """`requests`: the micro-batch's sequences in pack (thd) or batch (bshd) order."""
        session = _Session("replay", requests, on_missing)
        _active.append(session)
        try:
            yield
        finally:
            _active.remove(session)

    @staticmethod
    def attach(carrier, requests: RequestTopk | Sequence[RequestTopk], on_missing: str = "compute") -> None:
        """Replay for every forward (and recompute) of the micro-batch with this packed_seq_params
        (or attention mask) object, in or out of a context; a context around it replaces this."""
        setattr(carrier, _ATTR, _Bound(_Session("replay", requests, on_missing, explicit=True)))

    @staticmethod
    def mode() -> str:
        return _active[-1].mode if _active else "off"


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is None or task() != -1


def _bound(carrier: tuple) -> _Bound | None:
    """The session for this layer call, bound to the micro-batch's carrier (see module doc)."""
    obj = next((c for c in carrier if c is not None), index_share._fallback)  # the object IndexShare uses
    bound = getattr(obj, _ATTR, None)
    if _active:
        if bound is None or bound.session is not _active[-1]:
            bound = _Bound(_active[-1])
            setattr(obj, _ATTR, bound)
        return bound
    if bound is None or bound.session.explicit or _in_backward():
        return bound
    delattr(obj, _ATTR)  # a plain forward: a closed context no longer applies to this object
    return None


def resolve(layer, starts: torch.Tensor, carrier: tuple, compute: Callable[[], torch.Tensor],
            rows: torch.Tensor | None = None) -> torch.Tensor:
    """The top-k [T, index_topk] (flat, int64) a computing layer attends with; `compute` runs its indexer.
    Under context parallelism `rows` are this rank's queries (global flat rows of the micro-batch,
    whose `starts` are global) and the result has one row per query."""
    bound = None if layer.is_mtp_layer else _bound(carrier)  # MTP: never in payloads
    if bound is None:
        return compute()
    types = layer.config.dsa_indexer_types
    slot, num_slots = types[:layer.layer_number - 1].count("full"), types.count("full")
    if bound.session.mode == "record" and rows is not None:
        raise NotImplementedError("recording the indexer top-k under context parallelism is not supported: "
                                  "record at context_parallel_size 1 (replay works at any size)")
    if bound.session.mode == "record":
        kept = None if bound.recorded is None else bound.recorded.topk.get(slot)
        if kept is not None and _in_backward():  # recompute: exactly the forward's top-k
            return kept.to(starts.device, torch.int64)
        if bound.recorded is None or kept is not None:  # a new forward (bshd ones share a carrier)
            bound.recorded = RecordedForward(starts.cpu(), num_slots, ReplayLayout.from_model_config(layer.config))
            bound.session.recording.forwards.append(bound.recorded)
        topk = compute()
        bound.recorded.topk[slot] = topk.to("cpu", torch.int32)
        return topk
    return _replayed(layer, bound, slot, num_slots, starts, carrier[0], compute, rows)


def _fail(req_index: int, req: RequestTopk, layer, slot: int, num_slots: int, what: str):
    name = f"request {req_index}" + (f" ({req.sample_id})" if req.sample_id is not None else "")
    raise ValueError(f"indexer replay: {name}, layer {layer.layer_number} (indexer layer {slot + 1} of "
                     f"{num_slots}): {what}")


def _segments(starts: torch.Tensor, packed_seq_params) -> list[tuple[int, int, int]]:
    seg_starts, counts = torch.unique_consecutive(starts, return_counts=True)
    padded = list(zip(seg_starts.tolist(), counts.tolist()))
    real = [n for _, n in padded]
    if packed_seq_params is not None and packed_seq_params.cu_seqlens_q_padded is not None:
        real = torch.diff(packed_seq_params.cu_seqlens_q).tolist()
    return [(a, n, r) for (a, n), r in zip(padded, real)]


def _replayed(layer, bound: _Bound, slot, num_slots, starts, packed_seq_params, compute, rows=None) -> torch.Tensor:
    """The replayed top-k of the queries at global flat rows `rows` (context parallel: this rank's;
    None: every row), [len(rows), index_topk] flat indices into the whole packed micro-batch."""
    session, k, device = bound.session, layer.index_topk, starts.device
    reqs, segments = session.requests, _segments(starts, packed_seq_params)
    if len(reqs) != len(segments):
        raise ValueError(f"indexer replay: the micro-batch has {len(segments)} sequences but the "
                         f"payload {len(reqs)} requests (layer {layer.layer_number})")
    total = starts.shape[0]
    whole = rows is None
    q_rows = torch.arange(total, device=device) if whole else rows
    n = q_rows.shape[0]
    if not whole:  # which request and position each of this rank's rows is: host bookkeeping
        rows_cpu = rows.cpu()
        seg_starts = torch.tensor([a for a, _, _ in segments])
        seg_of = torch.searchsorted(seg_starts, rows_cpu, right=True) - 1
        pos_cpu = rows_cpu - seg_starts[seg_of]
    local = torch.full((n, k), -1, dtype=torch.int64, device=device)
    given = torch.zeros(n, dtype=torch.bool, device=device)
    tokens = torch.zeros(n, dtype=torch.int64, device=device)  # request length (rows + 1) per row
    for r, (req, (a, padded, real)) in enumerate(zip(reqs, segments)):
        if req.num_layers != num_slots:
            _fail(r, req, layer, slot, num_slots, f"payload has {req.num_layers} indexer layers, the model "
                  f"computes top-k in {num_slots} layers")
        if req.index_topk != k:
            _fail(r, req, layer, slot, num_slots, f"payload top-k width {req.index_topk}, the model's index_topk is {k}")
        if not real - 1 <= req.rows <= padded:
            _fail(r, req, layer, slot, num_slots, f"payload has {req.rows} rows (len(tokens) − 1) but its "
                  f"sequence has {real} tokens" + (f" ({padded} padded)" if padded != real else "")
                  + f"; expected {real - 1} to {padded} rows")
        if whole:  # every row of the request, in order: a slice
            local[a:a + req.rows] = req.layer(slot).to(device)
            given[a:a + req.rows] = True
            tokens[a:a + req.rows] = req.rows + 1
            continue
        mine = ((seg_of == r) & (pos_cpu < req.rows)).nonzero().flatten()
        at = mine.to(device)
        local[at] = req.layer(slot)[pos_cpu[mine]].to(device, torch.int64)
        given[at] = True
        tokens[at] = req.rows + 1

    q_starts = starts if whole else starts[rows]
    pos = q_rows - q_starts
    ordered = local.sort(dim=1).values
    bad_keys = [local < -1, local >= tokens[:, None], local > pos[:, None],  # per key
                (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)]
    checks = torch.stack([b.any(1) for b in bad_keys] + [(local < 0).all(1)], 1) & given[:, None]
    found = checks.any(0).tolist()  # the one host sync per layer
    messages = ("selects key {key}, below −1", "selects key {key}, beyond the request's {n} tokens",
                "selects key {key}, outside its causal window [0, {i}]", "selects key {key} twice",
                "is all −1 (not reported; on_missing='error')")
    for kind, message in enumerate(messages):
        if found[kind] and (kind < 4 or session.on_missing == "error"):
            t = int(checks[:, kind].nonzero()[0, 0])
            row = int(q_rows[t])
            r = next(j for j, (a, n, _) in enumerate(segments) if a <= row < a + n)
            i = row - segments[r][0]
            key = int((ordered[t, 1:] if kind == 3 else local[t])[bad_keys[kind][t]][0]) if kind < 4 else None
            _fail(r, reqs[r], layer, slot, num_slots, f"row {i} " + message.format(key=key, n=reqs[r].rows + 1, i=i))

    # Rows not in the payload: the most recent index_topk keys, self included (see module doc).
    window = q_rows[:, None] - torch.arange(k, device=device)
    topk = torch.where(given[:, None], torch.where(local >= 0, local + q_starts[:, None], -1),
                       torch.where(window >= q_starts[:, None], window, -1))
    if found[4]:
        topk = torch.where(checks[:, 4, None], compute(), topk)
    return topk
