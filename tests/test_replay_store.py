"""The compact replay store (model/replay_store.py): exact round trips of indexer top-k sets,
row-range reads and a refused foreign file. The sizes are in benchmarks/bench_replay.py."""

import numpy as np
import pytest
import torch

from glm5_bridge.model.replay_store import (BLOCK_ROWS, ReplayStore, ReplayStoreWriter, decode_block, decode_varints,
                                            encode_block, encode_varints)


def _causal_topk(rows: int, k: int, seed: int) -> np.ndarray:
    """Random causal selections: row r picks min(k, r + 1) distinct keys of 0 … r, in random slot
    order, −1 after them; every 7th row unused (−1 only), as padding rows are."""
    rng = np.random.default_rng(seed)
    out = np.full((rows, k), -1, dtype=np.int32)
    for r in range(rows):
        if r % 7 == 6:
            continue
        keys = rng.choice(r + 1, size=min(k, r + 1), replace=False)
        out[r, :keys.size] = keys
    return out


def _sets(t) -> list[set]:
    t = np.asarray(t)
    return [set(row[row >= 0].tolist()) for row in t]


def test_varints_round_trip_at_every_width():
    values = np.array([0, 1, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**28, 2**35 - 1], dtype=np.uint64)
    data = encode_varints(values)
    assert len(data) == 1 + 1 + 1 + 2 + 2 + 3 + 3 + 4 + 5 + 5
    decoded, used = decode_varints(data + b"\x05", len(values))
    assert used == len(data) and decoded.tolist() == values.tolist()


@pytest.mark.parametrize("rows,k", [(1, 4), (40, 16), (BLOCK_ROWS * 3 + 5, 32)])
def test_a_block_keeps_every_row_set(rows, k):
    topk = _causal_topk(rows, k, seed=rows)
    out = decode_block(encode_block(topk), rows, k)
    assert out.shape == (rows, k) and _sets(out) == _sets(topk)
    valid = out >= 0
    assert all(np.all(np.diff(row[ok]) > 0) and ok[:ok.sum()].all() for row, ok in zip(out, valid))  # ascending, −1 last


def test_store_round_trip_uneven_requests_and_row_ranges(tmp_path):
    requests = {"a": [_causal_topk(150, 16, seed=s) for s in (1, 2, 3)], "b": [_causal_topk(9, 16, seed=s) for s in (4, 5, 6)]}
    with ReplayStoreWriter(tmp_path / "r.r3") as w:
        for name, layers in requests.items():
            for slot, topk in enumerate(layers):
                w.add_rows(name, slot, 0, topk[:100])
                if topk.shape[0] > 100:
                    w.add_rows(name, slot, 100, torch.from_numpy(topk[100:]))  # streamed in two parts
    store = ReplayStore(tmp_path / "r.r3")
    assert store.requests() == ["a", "b"] and store.shape("a") == (150, 3, 16) and store.shape("b") == (9, 3, 16)
    for name, layers in requests.items():
        for slot, topk in enumerate(layers):
            assert _sets(store.layer(name, slot)) == _sets(topk)
    assert _sets(store.layer("a", 1, rows=(60, 131))) == _sets(requests["a"][1][60:131])
    assert not list(tmp_path.glob(".*tmp*"))


def test_a_failed_write_leaves_nothing_and_a_foreign_file_is_refused(tmp_path):
    with pytest.raises(RuntimeError):
        with ReplayStoreWriter(tmp_path / "r.r3") as w:
            w.add_rows("a", 0, 0, _causal_topk(10, 4, seed=0))
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "x.r3").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match=r"x\.r3: not a glm5-bridge replay store"):
        ReplayStore(tmp_path / "x.r3")
