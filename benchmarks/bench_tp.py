"""DSA under tensor parallelism, in one run on P GPUs (torchrun), each part against its baseline:

  indexer    top-k of GLM-5's indexer (32 heads × 128, top-k 2048), our score kernel + radix select:
             "replicated" (every rank scores all T rows: megatron-core replicates the indexer) against
             "split" (attention/topk.select_topk_split: 2 of 2P row chunks per rank, then an
             all-gather of the int32 top-k);
  attention  sparse MLA fwd + bwd at GLM-5 dims (64 heads in all, q/kv 576, v 512, random causal
             top-k 2048) on the "tilelang" backend: "heads_split" (megatron's layout: each rank its
             64/P heads over all T tokens) against "tokens_split" (attention/token_parallel.attend:
             all heads of one row_bounds range of the tokens, two all-to-alls each way; on a GPU
             the kernels get the received head-blocked rows through kernels/ops' transposed copies)
             and, on a GPU, "tokens_split_in_place" (the same with our kernels reading and writing
             the head-blocked rows in place, ops.ours_take_head_blocks: the default).
  dense      (with --emulate) the rank's dense bar: causal SDPA at 64/P heads, head dim 256.

    torchrun --nproc-per-node 8 benchmarks/bench_tp.py [--parts indexer,attention] [--seqs 8192,16384] [--out f.json]
    python3 benchmarks/bench_tp.py --emulate 2,4,8     # one GPU: every rank's compute, no wire

Same random inputs on every rank (seeded). Rank 0 prints one `RESULT {json}` line per (part, S,
variant) and writes them to --out: per repetition the slowest rank's time (a TP layer waits for it;
the attention's is the mean of BACK_TO_BACK calls issued back to back, so the host's launches overlap
the GPU's work as in a model), then the median and spread over repetitions. Checks: `same_topk`
(split = replicated), and for the attention the largest relative difference of the tokens-split
output from the heads-split one.
Without a GPU it runs on the CPU over gloo (torch indexer, unfused attention at small dims): a smoke
test of the script, not a timing.

--emulate P,...: one process on one GPU plays each rank r of P in turn, in torch's "fake" process
group (torch.testing._internal.distributed.fake_pg: a collective copies locally, nothing crosses a
wire), so each rank's kernels and copies run exactly as on P GPUs while the collectives cost
nothing. Rows then carry the rank's time; `wire_bytes` is what the rank's collectives would move
(received bytes), and the "per_rank" rows add it at --link-gbs as an estimate, marked as such,
against the slowest rank's compute and the rank's dense bar. The baselines (replicated indexer,
heads split) do the same work on every rank, so they run as rank 0 only. --query-costs C,...
repeats the tokens-split attention at each token_parallel.QUERY_COST_KEYS (the rows' split
between ranks; rows carry query_cost), to pick the cost that makes the slowest rank fastest.
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if "glm5_bridge" not in sys.modules:  # load glm5_bridge's attention and kernels without the model stack
    pkg = types.ModuleType("glm5_bridge")
    pkg.__path__ = [str(ROOT / "glm5_bridge")]
    sys.modules["glm5_bridge"] = pkg

from timing import dense_attention, times_ms  # noqa: E402  (benchmarks/timing.py)

from glm5_bridge.model.attention import backends, token_parallel  # noqa: E402
from glm5_bridge.model.attention.topk import row_bounds, select_topk_split  # noqa: E402
from glm5_bridge.kernels.reference import random_causal_topk  # noqa: E402

TOPK, SCALE = 2048, 1 / 16
# The attention's calls are timed this many back to back per repetition (timing.times_ms's inner):
# a rank's fwd + bwd is ~3 ms at TP 8, where the host time before its first kernel would otherwise count.
BACK_TO_BACK = 4


def timed(fn, reps, device, group, inner=1):
    """Median and spread over repetitions of the slowest rank's time (inner: calls back to back per
    repetition, timing.times_ms)."""
    t = torch.tensor(times_ms(fn, reps, device=device, inner=inner), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    t = t.tolist()
    return round(statistics.median(t), 3), round(max(t) - min(t), 3)


def wire_bytes(part, s, parts, rank, heads=64):
    """Bytes rank `rank` receives in its collectives for one sequence of s tokens: the split
    indexer's all-gather of int32 top-k rows (2 chunks from each other rank); the tokens-split
    attention's all-to-alls, fwd (q of its rows in, out of the others' rows back) and bwd (their
    gradients)."""
    if part == "indexer":
        return (parts - 1) * 2 * -(-s // (2 * parts)) * TOPK * 4
    bounds = row_bounds((s,), parts, TOPK, query_cost=token_parallel.QUERY_COST_KEYS)
    mine = bounds[rank + 1] - bounds[rank]
    one_way = (parts - 1) * mine * 576 + (s - mine) * 512  # bf16 elements × heads per rank, fwd
    fwd = one_way * (heads // parts) * 2
    back = ((parts - 1) * mine * 512 + (s - mine) * 576) * (heads // parts) * 2
    return {"fwd": fwd, "fwd_bwd": fwd + back}


def bench_indexer(s, device, group, reps, baseline=True):
    heads, dim = 32, 128
    gen = torch.Generator(device=device).manual_seed(s)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(s, heads, dim, device=device, generator=gen).to(dtype)
    k = torch.randn(s, dim, device=device, generator=gen).to(dtype)
    w = torch.randn(s, heads, device=device, generator=gen) * (heads ** -0.5 * dim ** -0.5)
    starts = torch.zeros(s, dtype=torch.int64, device=device)
    select = backends.fused_select_topk  # our kernel on bf16 CUDA inputs, else (the CPU smoke run) torch's
    variants = {"replicated": lambda: select(q, k, w, starts, TOPK),
                "split": lambda: select_topk_split(select, q, k, w, starts, TOPK, group)}
    exchanged = dist.get_backend(group) != "fake"  # a fake group's collectives copy locally
    same = torch.equal(*(v().sort(1).values for v in variants.values())) if baseline and exchanged else None
    for name, fn in variants.items():
        if name == "replicated" and not baseline:
            continue
        ms, spread = timed(fn, reps, device, group)
        wire = wire_bytes("indexer", s, group.size(), group.rank()) if name == "split" else 0
        yield dict(part="indexer", impl=name, S=s, heads=heads, dim=dim, ms=ms, spread_ms=spread, same_topk=same,
                   wire_bytes=wire)


def bench_attention(s, device, group, reps, baseline=True):
    parts, rank = group.size(), group.rank()
    heads, d, v = (64, 576, 512) if device == "cuda" else (4 * parts, 40, 32)
    backend = backends.get_backend("tilelang" if device == "cuda" else "megatron")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(s)
    q_all = torch.randn(s, heads, d, device=device, generator=gen).to(dtype)
    kv = torch.randn(s, d, device=device, generator=gen).to(dtype).requires_grad_()
    dout_all = torch.randn(s, heads, v, device=device, generator=gen).to(dtype)
    topk = random_causal_topk([s], TOPK, device=device, generator=gen)
    mine = slice(rank * heads // parts, (rank + 1) * heads // parts)
    q, dout = q_all[:, mine].contiguous().requires_grad_(), dout_all[:, mine].contiguous()

    def heads_split():
        return backend(q, kv, topk, SCALE, v, packed=True)

    def tokens_split():
        return token_parallel.attend(backend, q, kv, topk, SCALE, v, packed=True, group=group, lengths=(s,))

    # in_place: our kernels' head_blocks for the variant (None: the CPU's unfused backend, no kernels)
    cuda = device == "cuda"
    variants = [("heads_split", heads_split, None), ("tokens_split", tokens_split, False if cuda else None)]
    if cuda:
        variants.append(("tokens_split_in_place", tokens_split, True))
    outs = {}
    for name, fn, in_place in variants:
        if name == "heads_split" and not baseline:
            continue
        with kernels_in_place(in_place):
            outs[name] = fn().detach().float()

            def step(fn=fn):
                q.grad = kv.grad = None
                fn().backward(dout)

            fwd_ms, fwd_spread = timed(lambda fn=fn: fn().detach(), reps, device, group, BACK_TO_BACK)
            step_ms, step_spread = timed(step, reps, device, group, BACK_TO_BACK)
        wire = wire_bytes("attention", s, parts, rank, heads) if name != "heads_split" else {"fwd": 0, "fwd_bwd": 0}
        yield dict(part="attention", impl=name, S=s, heads=heads, heads_per_rank=heads // parts, fwd_ms=fwd_ms,
                   fwd_spread_ms=fwd_spread, fwd_bwd_ms=step_ms, fwd_bwd_spread_ms=step_spread,
                   wire_bytes=wire["fwd_bwd"], fwd_wire_bytes=wire["fwd"], query_cost=token_parallel.QUERY_COST_KEYS,
                   back_to_back=BACK_TO_BACK)
    if dist.get_backend(group) == "fake":  # a fake group's all-to-alls did not exchange: nothing to compare
        return
    if "tokens_split_in_place" in outs:
        diff = (outs["tokens_split_in_place"] - outs["tokens_split"]).norm() / outs["tokens_split"].norm()
        dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
        yield dict(part="attention_check", S=s, in_place_vs_copies_rel=round(diff.item(), 6))
    if "heads_split" not in outs:
        return
    diff = (outs["tokens_split"] - outs["heads_split"]).norm() / outs["heads_split"].norm()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
    yield dict(part="attention_check", S=s, tokens_vs_heads_split_rel=round(diff.item(), 6))


@contextlib.contextmanager
def kernels_in_place(on: bool | None):
    """For the body, our kernels take head-blocked rows in place (True) or get ops' transposed copies
    (False), whatever the default; None leaves the kernels alone."""
    if on is None:
        yield
        return
    from glm5_bridge.kernels import ops

    saved, ops.ours_ops().head_blocks = ops.ours_ops().head_blocks, on
    try:
        yield
    finally:
        ops.ours_ops().head_blocks = saved


def bench_dense(s, device, group, reps, baseline=True, heads=64, dim=256):
    """The rank's dense bar: causal SDPA fwd + bwd at its 64/P heads, head dim 256 (bench_dsa's). The
    same on every rank: with --emulate only rank 0 (baseline) runs it."""
    if not baseline:
        return
    h = heads // group.size()
    ms, spread = timed(dense_attention(s, h, dim, device)[1], reps, device, group)
    yield dict(part="dense", impl="sdpa", S=s, heads_per_rank=h, dim=dim, fwd_bwd_ms=ms, fwd_bwd_spread_ms=spread)


PARTS = {"indexer": bench_indexer, "attention": bench_attention, "dense": bench_dense}


def precompile(head_counts, head_blocks=()):
    """Build the kernels the GPU runs use, one process per kernel, in parallel (TileLang's disk cache
    then serves this process; a kernel takes 10–30 s to build the first time); head_blocks: the P of
    tokens-split attention, whose 64-head kernels read head-blocked rows."""
    import subprocess

    stub = (f"import sys, types; p = types.ModuleType('glm5_bridge'); p.__path__ = [{str(ROOT / 'glm5_bridge')!r}]; "
            "sys.modules['glm5_bridge'] = p; ")
    jobs = [f"from glm5_bridge.kernels.ops import compile_kernels; compile_kernels({h}, {TOPK}, {SCALE}, parts=('{part}',))"
            for h in sorted(set(head_counts)) for part in ("fwd", "bwd", "delta", "slots")]
    jobs += [f"from glm5_bridge.kernels.ops import compile_kernels; "
             f"compile_kernels(64, {TOPK}, {SCALE}, parts=('{part}',), head_blocks={p})"
             for p in sorted(set(head_blocks) - {1}) for part in ("fwd", "bwd")]
    jobs += ["from glm5_bridge.kernels import indexer; indexer.get_logits_kernel(32, 128)",
             f"from glm5_bridge.kernels import radix_topk; radix_topk.get_select_kernel({TOPK})"]
    procs = [subprocess.Popen([sys.executable, "-c", stub + job], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for job in jobs]
    for job, proc in zip(jobs, procs):
        if proc.wait():
            print(f"precompile failed: {job}\n{proc.stderr.read().decode()[-2000:]}", flush=True)


def each_fake_rank(ranks_list):
    """(P, r, group) for every rank r of each P in `ranks_list`, in turn, with torch's "fake" process
    group of rank r of P initialised for the body of the loop (its collectives copy locally, nothing
    crosses a wire) and destroyed after it, also when the loop is left early. bench_dsa.py's and
    bench_cp.py's one-GPU emulations use it too."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    for parts in ranks_list:
        for rank in range(parts):
            dist.init_process_group("fake", rank=rank, world_size=parts, store=FakeStore())
            try:
                yield parts, rank, dist.group.WORLD
            finally:
                dist.destroy_process_group()


def emulate(parts_list, seqs, ranks_list, reps, link_gbs, out_path, query_costs=()):
    """--emulate: every rank r of each P in turn on this GPU, over the fake process group. The rows
    so far are saved after every rank (a run cut short by a time limit keeps them). query_costs:
    the attention again at each QUERY_COST_KEYS after the default's rows (summarised per cost)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    if device == "cuda":
        precompile([64] + [64 // parts for parts in ranks_list], head_blocks=ranks_list)
    rows = []
    default_cost = token_parallel.QUERY_COST_KEYS
    for parts, rank, group in each_fake_rank(ranks_list):
        for s in seqs:
            for part in parts_list:
                for row in PARTS[part](s, device, group, reps, baseline=rank == 0):
                    row = dict(kind="bench_tp_emulated", tp=parts, rank=rank, device=name, **row)
                    rows.append(row)
                    print("RESULT " + json.dumps(row), flush=True)
            for cost in query_costs if "attention" in parts_list else ():
                token_parallel.QUERY_COST_KEYS = cost
                try:
                    for row in bench_attention(s, device, group, reps, baseline=False):
                        row = dict(kind="bench_tp_query_cost", tp=parts, rank=rank, device=name, **row)
                        rows.append(row)
                        print("RESULT " + json.dumps(row), flush=True)
                finally:
                    token_parallel.QUERY_COST_KEYS = default_cost
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)
    rows += per_rank_summary([r for r in rows if r["kind"] == "bench_tp_emulated" and "impl" in r], link_gbs)
    rows += query_cost_summary([r for r in rows if r["kind"] == "bench_tp_query_cost"])
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)


def query_cost_summary(rows):
    """Per (S, P, variant, query cost): the slowest rank's attention fwd + bwd and which rank it is."""
    out = []
    for key in sorted({(r["S"], r["tp"], r["impl"], r["query_cost"]) for r in rows if r["part"] == "attention"}):
        ranks = {r["rank"]: r["fwd_bwd_ms"] for r in rows
                 if r["part"] == "attention" and (r["S"], r["tp"], r["impl"], r["query_cost"]) == key}
        slowest = max(ranks, key=ranks.get)
        row = dict(kind="query_cost", S=key[0], tp=key[1], impl=key[2], query_cost=key[3],
                   slowest_rank=slowest, slowest_fwd_bwd_ms=ranks[slowest], ranks=len(ranks))
        out.append(row)
        print("RESULT " + json.dumps(row), flush=True)
    return out


def per_rank_summary(rows, link_gbs):
    """Per (S, P): the slowest rank's indexer + attention fwd + bwd, before (replicated indexer, heads
    split) and after (split indexer, tokens split; + its collectives' bytes at link_gbs, an
    estimate), against the rank's dense bar."""
    out = []
    for s, parts in sorted({(r["S"], r["tp"]) for r in rows}):
        def worst(part, impl, key):
            got = [r[key] for r in rows if (r["S"], r["tp"], r["part"], r["impl"]) == (s, parts, part, impl)]
            return max(got) if got else None

        replicated = worst("indexer", "replicated", "ms")
        parts_ms = dict(index_split=worst("indexer", "split", "ms"), heads_split=worst("attention", "heads_split", "fwd_bwd_ms"),
                        tokens_split=worst("attention", "tokens_split", "fwd_bwd_ms"), dense=worst("dense", "sdpa", "fwd_bwd_ms"))
        if replicated is None or None in parts_ms.values():
            continue
        in_place = worst("attention", "tokens_split_in_place", "fwd_bwd_ms")  # GPU only
        wire = worst("indexer", "split", "wire_bytes") + worst("attention", "tokens_split", "wire_bytes")
        wire_ms = wire / (link_gbs * 1e9) * 1e3
        before = replicated + parts_ms["heads_split"]
        after = parts_ms["index_split"] + parts_ms["tokens_split"]
        row = dict(kind="per_rank", S=s, tp=parts, heads_per_rank=64 // parts, before_ms=round(before, 3),
                   after_compute_ms=round(after, 3), wire_bytes=wire, link_gbs=link_gbs,
                   wire_ms_estimate=round(wire_ms, 3), after_ms_estimate=round(after + wire_ms, 3),
                   dense_ms=parts_ms["dense"], **{f"{k}_ms": v for k, v in parts_ms.items() if k != "dense"},
                   indexer_replicated_ms=replicated)
        if in_place is not None:
            row.update(tokens_split_in_place_ms=in_place,
                       after_in_place_ms_estimate=round(parts_ms["index_split"] + in_place + wire_ms, 3))
        out.append(row)
        print("RESULT " + json.dumps(row), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="indexer,attention")
    ap.add_argument("--seqs", default="8192,16384")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "bench_tp.json"))
    ap.add_argument("--emulate", default="", help="P,...: play every rank of P on this one GPU (no wire)")
    ap.add_argument("--query-costs", default="", help="C,...: with --emulate, the attention also at these "
                    "token_parallel.QUERY_COST_KEYS")
    ap.add_argument("--link-gbs", type=float, default=350.0,
                    help="--emulate's assumed all-to-all / all-gather bandwidth per GPU, GB/s")
    a = ap.parse_args()
    seqs = [int(x) for x in a.seqs.split(",")]
    if a.emulate:
        emulate(a.parts.split(","), seqs, [int(x) for x in a.emulate.split(",")], a.reps, a.link_gbs, a.out,
                [int(x) for x in a.query_costs.split(",") if x])
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    group = dist.group.WORLD
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:  # one builder per host; the others wait
            precompile([64, 64 // group.size()], head_blocks=[group.size()])
        dist.barrier()
    rows = []
    for s in seqs:
        for part in a.parts.split(","):
            for row in PARTS[part](s, device, group, a.reps):
                row = dict(kind="bench_tp", tp=group.size(), device=device, **row)
                rows.append(row)
                if group.rank() == 0:
                    print("RESULT " + json.dumps(row), flush=True)
    if group.rank() == 0:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
