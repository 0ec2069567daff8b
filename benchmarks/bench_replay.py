"""Indexer replay at GLM-5.2 scale: bytes per token of sglang's form against the compact store
(model/replay_store.py), encode / load throughput, and the peak memory of a process loading a layer.

    .venv/bin/python benchmarks/bench_replay.py [--tokens 8192 32768 65536] [--out results.json]

GLM-5.2 layout: 78 decoder layers, 21 of them computing top-k (IndexShare), index_topk 2048.
sglang's form: int32 for every decoder layer, 78 × 2048 × 4 B a token (its JSON base64 is 4/3 of
that again). Ours: the store's bytes for the 21 computing layers. One layer of synthetic causal
top-k is generated per size and stored once per computing layer's worth (the layers are coded
independently, so bytes and times scale by 21; `stored_bytes_per_token` counts 21 layers).

Synthetic top-k with locality (no recorded GLM-5.2 selections are at hand): a query at position
r < 2048 selects all its keys; later, 64 sink keys, the 512 most recent keys and 1472 "content"
keys from before the window, of which a fraction `churn` is replaced by other keys at each next
query (the rest stay: nearby queries select mostly the same keys). Rows are written in a shuffled
slot order, as an engine's top-k comes. Rows: churn 0.01 and 0.05.

Peak memory: a fresh process opens the store and loads one whole layer (the largest slice replay
reads at once); its resident size while loading (sampled every 2 ms) beyond that just before, against
the slice's bytes and the bound 1.25 × slice + 1 GiB.

Ingest (`--ingest-tokens`, default 8K; a 64K line is 54 GB of base64 and ~7 min on 2 cores): one rollout line in sglang's form, every decoder layer, produced while it is read, streamed
by `replay_ingest.ingest_rollouts` in a fresh process; GB/s count the payload's int32 bytes, and
its resident size while ingesting (sampled) beyond that before. Prints one RESULT line per row; --out
gets them all.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from glm5_bridge.model.replay_store import ReplayStore, ReplayStoreWriter

DECODER_LAYERS, COMPUTING_LAYERS, TOPK = 78, 21, 2048
SINKS, WINDOW = 64, 512


def synthetic_layer(tokens: int, churn: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.full((tokens, TOPK), -1, dtype=np.int32)
    content_size = TOPK - SINKS - WINDOW
    content, member = None, np.zeros(tokens, dtype=bool)
    for r in range(tokens):
        if r < TOPK:
            row = np.arange(r + 1, dtype=np.int32)
        else:
            pool_end = r - WINDOW + 1  # content keys come from [SINKS, pool_end)
            if content is None:
                content = rng.choice(np.arange(SINKS, pool_end), size=content_size, replace=False)
                member[content] = True
            n = rng.binomial(content_size, churn)
            drop = rng.choice(content_size, size=n, replace=False)
            member[content[drop]] = False
            fresh = rng.integers(SINKS, pool_end, size=4 * n + 8)
            fresh = fresh[~member[fresh]]
            fresh = np.unique(fresh)[:n]
            while fresh.size < n:  # rare: collisions
                extra = rng.integers(SINKS, pool_end, size=4 * n + 8)
                fresh = np.unique(np.concatenate([fresh, extra[~member[extra]]]))[:n]
            content[drop] = fresh
            member[fresh] = True
            row = np.concatenate([np.arange(SINKS), np.arange(r - WINDOW + 1, r + 1), content]).astype(np.int32)
        out[r, :row.size] = rng.permutation(row)
    return out


_SAMPLER = """
import os, threading
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
high, done = [0], threading.Event()
def sample():  # the resident size while the work runs (ru_maxrss would include the set-up's peaks)
    while not done.wait(0.002):
        high[0] = max(high[0], rss())
"""

_PEAK = _SAMPLER + """
import os, resource, sys, time
from glm5_bridge.model.replay_store import ReplayStore
store = ReplayStore(sys.argv[1])
before = rss()
threading.Thread(target=sample, daemon=True).start()
t = time.perf_counter()
layer = store.layer("r", 0)
seconds = time.perf_counter() - t
done.set()
print(before, max(high[0], rss()), seconds, layer.numel() * 4)
"""


def measure(tokens: int, churn: float, folder: Path) -> dict:
    t = time.perf_counter()
    rows = synthetic_layer(tokens, churn, seed=tokens)
    generated = time.perf_counter() - t
    path = folder / f"{tokens}_{churn}.r3"
    t = time.perf_counter()
    with ReplayStoreWriter(path) as w:
        w.add_rows("r", 0, 0, rows)
    encode = time.perf_counter() - t
    layer_bytes = path.stat().st_size
    before, peak, load, slice_bytes = (float(x) for x in subprocess.run(
        [sys.executable, "-c", _PEAK, str(path)], capture_output=True, text=True, check=True).stdout.split())
    loaded = ReplayStore(path).layer("r", 0).numpy()
    exact = all(set(a[a >= 0].tolist()) == set(b[b >= 0].tolist()) for a, b in zip(rows, loaded))
    raw_layer = rows.nbytes
    sglang_per_token = DECODER_LAYERS * TOPK * 4
    ours_per_token = layer_bytes * COMPUTING_LAYERS / tokens
    return {"tokens": tokens, "churn": churn, "exact": exact,
            "sglang_bytes_per_token": sglang_per_token, "stored_bytes_per_token": round(ours_per_token, 1),
            "ratio": round(ours_per_token / sglang_per_token, 4),
            "encode_gb_per_s": round(raw_layer / encode / 1e9, 3), "load_gb_per_s": round(raw_layer / load / 1e9, 3),
            "load_peak_rss_extra_mib": round((peak - before) / 2**20, 1), "slice_mib": round(slice_bytes / 2**20, 1),
            "rss_bound_mib": round((1.25 * slice_bytes + 2**30) / 2**20, 1), "generate_s": round(generated, 1)}


_INGEST = _SAMPLER + """
import base64, io, json, os, resource, sys, time
import numpy as np
sys.path.insert(0, os.path.dirname(sys.argv[1]))
from bench_replay import COMPUTING_LAYERS, DECODER_LAYERS, TOPK, glm52_layout, synthetic_layer
from glm5_bridge.model import replay_ingest

tokens, churn, store = int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
layer = synthetic_layer(tokens, churn, seed=tokens)[:-1]          # len(tokens) - 1 rows
layout = glm52_layout()


class Line(io.RawIOBase):
    # one rollout line whose payload is every decoder layer of `layer`, base64-encoded as it is read
    def __init__(self):
        self.parts = [b'{"tokens": ' + json.dumps(list(range(tokens))).encode() + b', "meta_info": '
                      b'{"indexer_topk_num_layers": 78, "indexer_topk": "']
        self.row, self.pending = 0, b""
    def read(self, n=-1):
        while len(self.pending) < n and (self.parts or self.row < layer.shape[0]):
            if self.parts:
                self.pending += self.parts.pop(0)
                continue
            rows = layer[self.row:self.row + 3]                     # 3 rows: whole base64 quanta
            block = np.repeat(rows[:, None, :], DECODER_LAYERS, axis=1)
            self.pending += base64.b64encode(block.astype("<i4").tobytes())
            self.row += rows.shape[0]
            if self.row >= layer.shape[0]:
                self.parts.append(b'"}, "reward": 1.0}\\n')
        out, self.pending = self.pending[:n], self.pending[n:]
        return out


import builtins
replay_ingest.open = lambda path, mode: Line() if str(path) == "synthetic.jsonl" else builtins.open(path, mode)
before = rss()
threading.Thread(target=sample, daemon=True).start()
start = time.perf_counter()
replay_ingest.ingest_rollouts("synthetic.jsonl", store, layout)
seconds = time.perf_counter() - start
done.set()
print(seconds, layer.shape[0] * DECODER_LAYERS * TOPK * 4, max(high[0], rss()) - before)
"""


def glm52_layout():
    from glm5_bridge.model.config import load_hf_config
    from glm5_bridge.model.payload import ReplayLayout

    layout = ReplayLayout.from_hf_config(load_hf_config("GLM-5.2"))
    assert (layout.num_layers, len(layout.computing), layout.index_topk) == (DECODER_LAYERS, COMPUTING_LAYERS, TOPK)
    return layout


def measure_ingest(tokens: int, churn: float, folder: Path) -> dict:
    """A whole rollout line in sglang's form (every decoder layer, base64, the same synthetic layer
    in each), produced as it is read, streamed into a store by a fresh process."""
    seconds, raw, extra = (float(x) for x in subprocess.run(
        [sys.executable, "-c", _INGEST, str(Path(__file__).resolve()), str(tokens), str(churn),
         str(folder / f"ingest_{tokens}.r3")], capture_output=True, text=True, check=True, cwd=Path(__file__).parent).stdout.split())
    return {"tokens": tokens, "churn": churn, "ingest_payload_gb": round(raw / 1e9, 2),
            "ingest_gb_per_s": round(raw / seconds / 1e9, 3), "ingest_peak_rss_extra_mib": round(extra / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 65536])
    parser.add_argument("--churn", type=float, nargs="+", default=[0.01, 0.05])
    parser.add_argument("--ingest-tokens", type=int, nargs="*", default=[8192])
    parser.add_argument("--out")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in args.tokens:
            for churn in args.churn:
                results.append(measure(tokens, churn, Path(tmp)))
                print("RESULT", json.dumps(results[-1]), flush=True)
        for tokens in args.ingest_tokens:
            results.append(measure_ingest(tokens, args.churn[-1], Path(tmp)))
            print("RESULT", json.dumps(results[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
