"""R3 indexer replay (glm5_bridge/model/replay.py) on tiny fp32 models, CPU.

The decoder indexers are perturbed before replaying: computing would then pick other keys (checked),
so equal results prove the replayed top-k was used. The HF reference test forces transformers'
indexer output to the replayed indices: an independent dense-mask attention over exactly them.
"""

import base64
import json
import struct
from contextlib import contextmanager

import pytest
import torch
import torch.utils.checkpoint

from glm5_bridge.model.payload import ReplayLayout, from_store
from glm5_bridge.model.replay_store import ReplayStore, ReplayStoreWriter
from glm5_bridge.model.replay import IndexerReplay, RequestTopk
from glm5_bridge.testing import load_hf, load_megatron, packed_seq_params

TOL = 1e-5  # fp32 parity bound of tests/test_parity.py
LENGTHS = (21, 13, 6)  # packed requests; 21 and 13 are above index_topk = 8


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("GLM-5.2")  # 4 computing layers (1, 2, 3, 7), IndexShare on 4–6


@pytest.fixture(scope="module")
def model(path):
    return load_megatron(path)[1].train()


def _seqs(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g) for n in lengths]


def _batch(seqs):
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    return dict(input_ids=ids, position_ids=pos, attention_mask=None,
                packed_seq_params=packed_seq_params([len(s) for s in seqs]))


def _loss(logits):
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(9))
    return (logits * w).sum()


def _step(model, seqs, backward=True):
    """Packed logits [T, vocab] and, with backward, every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    logits = model(**_batch(seqs))[0]
    if not backward:
        return logits.detach(), {}
    _loss(logits).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@contextmanager
def _perturbed_indexers(model):
    """Decoder indexers moved so that computing would pick other keys; restored afterwards."""
    params = {n: p for n, p in model.named_parameters() if n.startswith("decoder.") and ".indexer." in n}
    saved = {n: p.detach().clone() for n, p in params.items()}
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in params.values():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    try:
        yield
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n])


def _assert_same(a, b):
    (la, ga), (lb, gb) = a, b
    assert torch.equal(la, lb)
    assert ga.keys() == gb.keys() and len(ga) > 100
    for name in ga:
        assert torch.equal(ga[name], gb[name]), name


def _record(model, seqs, backward=True):
    with IndexerReplay.recording() as rec:
        out = _step(model, seqs, backward)
    assert len(rec.forwards) == 1
    return out, rec.requests()


# --- record → replay ------------------------------------------------------------------------------

def test_record_replay_bit_identical(model):
    seqs = _seqs()
    recorded, reqs = _record(model, seqs)
    assert [r.shape for r in reqs] == [(n, 4, 8) for n in LENGTHS]
    with _perturbed_indexers(model):
        computed = _step(model, seqs, backward=False)[0]
        assert (computed - recorded[0]).abs().max() > 1e-2  # computing now differs
        with IndexerReplay.replaying(reqs):
            replayed = _step(model, seqs)
            again = _step(model, seqs)  # a second forward in the same context replays too
    _assert_same(recorded, replayed)
    _assert_same(recorded, again)


def test_recompute_outside_context_replays(model):
    """Activation recompute in backward, after the context has exited, replays the same top-k."""
    seqs = _seqs(seed=2)
    recorded, reqs = _record(model, seqs)
    batch = _batch(seqs)
    with _perturbed_indexers(model):
        model.zero_grad(set_to_none=True)
        with IndexerReplay.replaying(reqs):
            logits = torch.utils.checkpoint.checkpoint(lambda: model(**batch)[0], use_reentrant=False)
        _loss(logits).backward()  # the recompute runs here
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        # A plain forward of the same micro-batch objects afterwards computes again.
        with torch.no_grad():
            plain = model(**batch)[0]
            computed = _step(model, seqs, backward=False)[0]
    _assert_same(recorded, (logits.detach(), grads))
    assert torch.equal(plain, computed)


def test_attach_to_micro_batch(model):
    """attach(): the micro-batch with that packed_seq_params replays without a context (megatron's
    schedules build one per micro-batch in forward_step_func); another micro-batch object computes."""
    seqs = _seqs(seed=3)
    recorded, reqs = _record(model, seqs, backward=False)
    batch, other = _batch(seqs), _batch(seqs)
    IndexerReplay.attach(batch["packed_seq_params"], reqs)
    assert IndexerReplay.mode() == "off"  # no context
    with _perturbed_indexers(model), torch.no_grad():
        assert torch.equal(model(**batch)[0], recorded[0])
        assert (model(**other)[0] - recorded[0]).abs().max() > 1e-2


def test_record_mode_recompute_uses_the_forward_topk(model):
    """Recording: a recompute in backward reuses the recorded top-k, even if the indexer changed
    between forward and backward (so a recompute can never train on other indices)."""
    seqs = _seqs(seed=2)
    recorded, _ = _record(model, seqs)
    batch = _batch(seqs)
    model.zero_grad(set_to_none=True)
    with IndexerReplay.recording() as rec:
        logits = torch.utils.checkpoint.checkpoint(lambda: model(**batch)[0], use_reentrant=False)
        with _perturbed_indexers(model):
            _loss(logits).backward()
    assert len(rec.forwards) == 1
    _assert_same(recorded, (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                               if p.grad is not None}))


def test_record_replay_bshd_all_full_layers(tiny_checkpoint):
    """GLM-5 (every layer computes: 7 payload layers), two bshd micro-batches in one recording."""
    _, m = load_megatron(tiny_checkpoint("GLM-5"))
    g = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, 256, shape, generator=g) for shape in ((2, 20), (1, 12))]

    def run(ids):
        return m(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1),
                 attention_mask=None)

    with torch.no_grad():
        with IndexerReplay.recording() as rec:
            refs = [run(ids) for ids in batches]
        assert len(rec.forwards) == 2
        assert [r.shape for r in rec.requests(0)] == [(20, 7, 8)] * 2
        assert [r.shape for r in rec.requests(1)] == [(12, 7, 8)]
        with _perturbed_indexers(m):
            for i, (ids, ref) in enumerate(zip(batches, refs)):
                with IndexerReplay.replaying(rec.requests(i)):
                    out = run(ids)
                assert torch.equal(out, ref)
                assert (run(ids) - ref).abs().max() > 1e-2  # computing differs


# --- mangled stream against transformers with the indexer forced to it ------------------------------

def _random_causal(rows, layers, k, seed):
    """Valid payload unlike any indexer's: per row, up to k distinct random visible keys."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((rows, layers, k), -1, dtype=torch.int32)
    for i in range(rows):
        for j in range(layers):
            keys = torch.randperm(i + 1, generator=g)[:k]
            out[i, j, :len(keys)] = keys.to(torch.int32)
    return out


def _hf_forced(hf, seq, payload, k):
    """transformers' logits with every indexer returning the payload's rows (sglang form: the final
    position has no row and gets the documented window of the k most recent keys)."""
    n = len(seq)
    final = torch.arange(n - 1, n - 1 - k, -1).clamp(min=0)
    forced = []
    for j in range(payload.shape[1]):
        rows = torch.cat([payload[:, j].long(), final[None]])
        rows = torch.where(rows >= 0, rows, rows[:, :1])  # HF scatters indices: repeat a valid one for −1
        forced.append(rows[None].to(torch.int32))
    slots = iter(forced)
    for layer in hf.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.forward = (lambda t: lambda *a, **kw: t)(next(slots))
    assert next(slots, None) is None  # one payload layer per HF indexer, in order
    return hf(input_ids=seq[None]).logits[0]


def test_mangled_replay_matches_forced_transformers(model, path):
    seqs = _seqs(seed=5)
    recorded = _step(model, seqs, backward=False)[0]
    # sglang-shaped payloads: len(tokens) − 1 rows; training feeds all tokens.
    reqs = [RequestTopk(_random_causal(len(s) - 1, 4, 8, seed=10 + r)) for r, s in enumerate(seqs)]
    with IndexerReplay.replaying(reqs):
        replayed = _step(model, seqs, backward=False)[0]
    assert (replayed - recorded).abs().max() > 1e-2  # the stream changes the output
    hf = load_hf(path)
    with torch.no_grad():
        ref = torch.cat([_hf_forced(hf, s, r.tensor(), 8) for s, r in zip(seqs, reqs)])
    assert (replayed - ref).abs().max() <= TOL


# --- formats --------------------------------------------------------------------------------------

def test_sglang_encoding_layout():
    """sglang's form: row-major int32 LE over every decoder layer, a shared layer carrying a copy of
    its source's slot; decoding takes the computing layers back, with or without the layer count."""
    layout = ReplayLayout(("full", "full", "shared", "full"), index_topk=4)
    t = _random_causal(5, 3, 4, seed=0)
    meta = RequestTopk(t).to_sglang(layout)
    raw = base64.b64decode(meta["indexer_topk"])
    assert meta["indexer_topk_num_layers"] == 4
    every = t[:, [0, 1, 1, 2]]
    assert list(struct.unpack(f"<{every.numel()}i", raw)) == every.flatten().tolist()
    assert torch.equal(RequestTopk.from_sglang(meta, layout, num_tokens=6).tensor(), t)
    assert torch.equal(RequestTopk.from_sglang(meta, layout).tensor(), t)  # rows from the layer count
    del meta["indexer_topk_num_layers"]
    assert torch.equal(RequestTopk.from_sglang(meta, layout, num_tokens=6).tensor(), t)
    meta.update(prompt_tokens=2, completion_tokens=4)
    assert torch.equal(RequestTopk.from_sglang(meta, layout).tensor(), t)
    with pytest.raises(ValueError, match=r"^indexer replay: request 'x': indexer_topk holds 80 int32, which fits "
                                         r"neither 4 decoder layers nor 3 computing layers × \(len\(tokens\) − 1 = 6\) "
                                         r"rows × index_topk 4$"):
        RequestTopk.from_sglang(meta, layout, num_tokens=7, sample_id="x")


def _key_sets(t: torch.Tensor) -> torch.Tensor:
    """Each row's keys ascending, −1 last: equal for equal sets whatever the slot order."""
    big = torch.iinfo(t.dtype).max
    ordered = t.masked_fill(t < 0, big).sort(-1).values
    return ordered.masked_fill(ordered == big, -1)


def test_sglang_round_trip_packed_index_share(model, tmp_path):
    """Record 3 packed requests on GLM-5.2, ship them as sglang meta_info (len(tokens) − 1 rows,
    JSON), decode, replay on all tokens with other indexer weights: every position but each
    request's last reproduces the recording. The on-disk forms round-trip too: safetensors, and
    the compact store (the same key sets, in ascending order)."""
    seqs = _seqs(seed=6)
    with IndexerReplay.recording() as rec:
        recorded = _step(model, seqs, backward=False)
    reqs, rec_metas = rec.requests(), rec.sglang_meta()
    layout = ReplayLayout.from_model_config(model.config)
    metas = [json.loads(json.dumps(m)) for m in rec_metas]
    assert all(m["indexer_topk_num_layers"] == 7 for m in metas)  # every decoder layer, as sglang sends
    decoded = [RequestTopk.from_sglang(m, layout, len(s), sample_id=f"s{i}")
               for i, (m, s) in enumerate(zip(metas, seqs))]
    for d, r in zip(decoded, reqs):
        assert torch.equal(d.tensor(), r.tensor()[:-1])
    for i, d in enumerate(decoded):
        d.save(tmp_path / f"{i}.safetensors")
    lazy = [RequestTopk.load(tmp_path / f"{i}.safetensors") for i in range(3)]
    eager = [RequestTopk.load(tmp_path / f"{i}.safetensors", lazy=False) for i in range(3)]
    assert [x.sample_id for x in lazy] == ["s0", "s1", "s2"]
    for d, x, y in zip(decoded, lazy, eager):
        assert torch.equal(x.tensor(), d.tensor()) and torch.equal(y.tensor(), d.tensor())

    # the compact store (model/replay_store.py): the same key sets, read a layer at a time
    with ReplayStoreWriter(tmp_path / "topk.r3") as writer:
        for i, d in enumerate(decoded):
            for slot in range(d.num_layers):
                writer.add_rows(f"s{i}", slot, 0, d.layer(slot))
    store = ReplayStore(tmp_path / "topk.r3")
    compact = [from_store(store, f"s{i}") for i in range(3)]
    for d, c in zip(decoded, compact):
        assert c.shape == d.shape and torch.equal(_key_sets(c.tensor()), _key_sets(d.tensor()))
    with _perturbed_indexers(model):
        with IndexerReplay.replaying(decoded):
            out = _step(model, seqs, backward=False)[0]
        with IndexerReplay.replaying(lazy):
            out_lazy = _step(model, seqs, backward=False)[0]
        with IndexerReplay.replaying(compact):
            out_compact = _step(model, seqs, backward=False)[0]
    assert (out_compact - out).abs().max() <= TOL  # slots in another order: sums in another order
    last = torch.cumsum(torch.tensor(LENGTHS), 0) - 1
    keep = torch.ones(sum(LENGTHS), dtype=torch.bool)
    keep[last] = False
    # The final positions attend differently (window row), so their MoE routing changes and the
    # expert batches regroup: other positions then agree to rounding, not bit for bit. How much
    # rounding depends on the CPU's thread count (1.5e-6 with 2 threads), so the bound is the
    # file's fp32 parity bound, still 1000× under the window rows' difference below.
    assert (out[keep] - recorded[0][keep]).abs().max() <= TOL
    assert (out[~keep] - recorded[0][~keep]).abs().max() > 1e-2  # the window row is not the recorded one
    assert torch.equal(out_lazy, out)
    # Training on tokens[:-1] lines the rows up exactly: the whole output is the recording's.
    short = [s[:-1] for s in seqs]
    with IndexerReplay.recording() as rec:
        ref_short = _step(model, short, backward=False)[0]
    with _perturbed_indexers(model), IndexerReplay.replaying(rec.requests()):
        assert torch.equal(_step(model, short, backward=False)[0], ref_short)


def test_all_minus_one_rows_use_the_indexer(model):
    """A row of all −1 is 'not reported': the layer's own indexer fills it (unperturbed here, so the
    result is the recording's); the k-window fill of uncovered rows would differ at rows >= k."""
    seqs = _seqs(seed=7)
    recorded, reqs = _record(model, seqs, backward=False)
    holes = [r.tensor().clone() for r in reqs]
    holes[0][[9, 15, 20], 1] = -1
    holes[1][12, 3] = -1
    with IndexerReplay.replaying([RequestTopk(t) for t in holes]):
        out = _step(model, seqs, backward=False)[0]
    assert torch.equal(out, recorded[0])
    with _perturbed_indexers(model), IndexerReplay.replaying([RequestTopk(t) for t in holes]):
        assert not torch.equal(_step(model, seqs, backward=False)[0], recorded[0])  # computed rows moved


# --- bad payloads -----------------------------------------------------------------------------------

def _set(r, row, slot, value):
    """Mangle request r's row in one payload slot: first key := value, or the whole row := list."""
    def edit(ts):
        if isinstance(value, list):
            ts[r][row, slot] = torch.tensor(value, dtype=torch.int32)
        else:
            ts[r][row, slot, 0] = value
        return ts
    return edit


BAD = {
    "layers": (lambda ts: ts[:1] + [ts[1][:, :3]] + ts[2:],
               r"^indexer replay: request 1, layer 1 \(indexer layer 1 of 4\): payload has 3 indexer layers, "
               r"the model computes top-k in 4 layers$"),
    "length": (lambda ts: ts[:2] + [ts[2][:4]],
               r"^indexer replay: request 2, layer 1 .*: payload has 4 rows .* sequence has 6 tokens; "
               r"expected 5 to 6 rows$"),
    "width": (lambda ts: [t[..., :6] for t in ts], r"request 0, layer 1 .*top-k width 6, the model's index_topk is 8"),
    "causal": (_set(1, 3, 3, 5), r"^indexer replay: request 1, layer 7 \(indexer layer 4 of 4\): row 3 "
               r"selects key 5, outside its causal window \[0, 3\]$"),
    "request length": (_set(0, 2, 1, 30), r"request 0, layer 2 .*: row 2 selects key 30, beyond the request's 22 tokens$"),
    "below -1": (_set(2, 4, 2, -3), r"request 2, layer 3 .*: row 4 selects key -3, below −1$"),
    "duplicate": (_set(0, 10, 0, [4, 4, 0, 1, 2, 3, 5, 6]),
                  r"request 0, layer 1 .*: row 10 selects key 4 twice$"),
    "requests": (lambda ts: ts[:2], r"the micro-batch has 3 sequences but the payload 2 requests"),
    "all -1": (lambda ts: [ts[0], ts[1].index_fill_(0, torch.tensor([7]), -1), ts[2]],
               r"request 1, layer 1 .*: row 7 is all −1 \(not reported; on_missing='error'\)$"),
}


@pytest.fixture(scope="module")
def good(model):
    """A valid recorded payload for the bad-payload tests to mangle."""
    seqs = _seqs(seed=8)
    with torch.no_grad():
        return seqs, _record(model, seqs, backward=False)[1]


@pytest.mark.parametrize("case", BAD)
def test_bad_payload_rejected(model, good, case):
    seqs, reqs = good
    mangle, message = BAD[case]
    bad = [RequestTopk(t, sample_id=None) for t in mangle([r.tensor().clone() for r in reqs])]
    with pytest.raises(ValueError, match=message):
        with torch.no_grad(), IndexerReplay.replaying(bad, on_missing="error"):
            model(**_batch(seqs))


def test_error_names_sample_id(model, good):
    seqs, reqs = good
    t = reqs[1].tensor().clone()
    t[5, 0, 0] = 9
    bad = [reqs[0], RequestTopk(t, sample_id="rollout-17"), reqs[2]]
    with pytest.raises(ValueError, match=r"request 1 \(rollout-17\), layer 1 .*row 5"):
        with torch.no_grad(), IndexerReplay.replaying(bad):
            model(**_batch(seqs))
