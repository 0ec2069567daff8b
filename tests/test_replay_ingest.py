"""Streaming a rollout file's sglang indexer top-k into the compact store (model/replay_ingest.py):
the same key sets as RequestTopk.from_sglang decodes from the whole line, read in pieces as small
as 7 bytes; the rest of each line kept; bad payloads refused in one line with no store left."""

import json

import numpy as np
import pytest
import torch

from glm5_bridge.model import replay_ingest
from glm5_bridge.model.payload import ReplayLayout, RequestTopk
from glm5_bridge.model.replay_store import ReplayStore

LAYOUT = ReplayLayout(("full", "full", "shared", "full", "shared", "shared", "full"), index_topk=8)


def _topk(rows: int, seed: int) -> RequestTopk:
    """Random causal selections of the computing layers, −1 padded, one row unused."""
    rng = np.random.default_rng(seed)
    t = np.full((rows, len(LAYOUT.computing), LAYOUT.index_topk), -1, dtype=np.int32)
    for r in range(rows):
        for slot in range(t.shape[1]):
            if r == 3:
                continue
            keys = rng.choice(r + 1, size=min(LAYOUT.index_topk, r + 1), replace=False)
            t[r, slot, :keys.size] = keys
    return RequestTopk(torch.from_numpy(t))


def _sets(t: torch.Tensor) -> list:
    return [[set(row[row >= 0].tolist()) for row in t[:, s]] for s in range(t.shape[1])]


def _write(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _row(n: int, seed: int, **meta) -> tuple[dict, RequestTopk]:
    req = _topk(n - 1, seed)
    return {"tokens": list(range(n)), "reward": 1.0,
            "meta_info": {**meta, **req.to_sglang(LAYOUT), "completion_tokens": n // 2}}, req


@pytest.mark.parametrize("chunk", [7, 1 << 20])
def test_streamed_store_holds_what_a_whole_decode_gives(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(replay_ingest, "CHUNK", chunk)
    made = [_row(n, seed) for seed, n in enumerate([13, 5, 30])]
    rows = [r for r, _ in made]
    rows[1]["meta_info"] = {"indexer_topk_num_layers": 7, **{k: v for k, v in rows[1]["meta_info"].items()
                                                             if k != "indexer_topk_num_layers"}}
    rows[2]["meta_info"]["indexer_topk"] = rows[2]["meta_info"]["indexer_topk"].replace("/", "\\/")  # JSON escape
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r).replace("\\\\/", "\\/") + "\n" for r in rows) + "\n")
    out = replay_ingest.ingest_rollouts(path, tmp_path / "r.r3", LAYOUT, block_rows=4)
    store = ReplayStore(tmp_path / "r.r3")
    assert len(out) == 3 and store.requests() == [f"{path}:{i}" for i in (1, 2, 3)]
    for i, (row, (_, req)) in enumerate(zip(out, made)):
        assert row["tokens"] == rows[i]["tokens"] and row["meta_info"]["completion_tokens"] == rows[i]["meta_info"]["completion_tokens"]
        assert "indexer_topk" not in row["meta_info"] and row["meta_info"]["indexer_topk_store"] == f"{path}:{i + 1}"
        got = torch.stack([store.layer(f"{path}:{i + 1}", s) for s in range(3 + 1)], 1)
        assert _sets(got) == _sets(req.tensor())


def test_bad_payloads_are_refused_and_leave_no_store(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    good, _ = _row(9, 0)
    shared = _row(9, 1)[0]
    raw = np.frombuffer(__import__("base64").b64decode(shared["meta_info"]["indexer_topk"]), dtype="<i4").copy()
    raw = raw.reshape(8, 7, 8)
    raw[5, 2, 0] = 7 if raw[5, 1, 0] != 7 else 6  # layer 2 (shared) no longer copies layer 1 on row 5
    shared["meta_info"]["indexer_topk"] = __import__("base64").b64encode(raw.tobytes()).decode()
    cases = {
        "not base64": ({**good, "meta_info": {**good["meta_info"], "indexer_topk": "@@@@" * 10}},
                       r"rollouts\.jsonl:2'?: indexer_topk is not valid base64"),
        "shared copy differs": (shared, r"model\.layers\.2: row 5 differs from the top-k of model\.layers\.1"),
        "rows": ({**good, "tokens": list(range(12))}, r"holds 8 rows of 7 layers, len\(tokens\) − 1 is 11"),
    }
    for name, (bad, message) in cases.items():
        _write(path, [good, bad])
        with pytest.raises(ValueError, match=message):
            replay_ingest.ingest_rollouts(path, tmp_path / "r.r3", LAYOUT)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["rollouts.jsonl"], name
