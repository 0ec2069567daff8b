"""DSA kernel benchmark, one run on the device: our TileLang kernels vs megatron-core 0.19.2's TileLang
ops vs a torch reference, with dense causal flash attention (torch SDPA) as the bar.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/bench_dsa.py [--parts check,sparse,indexer,compile,dense]
        [--out $OUT/bench_dsa.json]

Prints one `RESULT {json}` line per measurement and a table last; writes every row to --out.

Sparse MLA (q [S,H,576], kv [S,576], top-k 2048 random causal, one sequence of S tokens; the
slots reordered used-first as SparseMLA passes them, i.e. as select_topk returns them):
  ours      our fwd and bwd kernels (kernels/sparse_mla_fwd.py, sparse_mla_bwd.py), raw calls; they
            skip a row's empty slot blocks. `ours_interleaved`: the same kernels on the slots
            as drawn (−1 interleaved: nothing to skip); `ours_fwd_noskip`: the forward built
            without skipping (64-key blocks, 2-stage pipeline, the kernel of earlier runs); below
            64 heads `ours_fwd_per_token` (one token per CTA) and `ours_fwd_simple_groups`
            (simple_kernel over the token groups the seesaw now runs)
  upstream  megatron-core's sparse_mla_fwd_interface / sparse_mla_bwd (4-D inputs, its own padding)
  iface     glm5_bridge.kernels.ops (the autograd path the model runs, fed the interleaved
            slots: its reordering is timed), GLM5_DSA_KERNELS=upstream and =ours
  torch     bf16 gather + einsum in 512-token chunks (the unfused path's math), forward only
FLOPs: nominal over all K slots, fwd 2·S·H·K·(576+512), bwd 2·S·H·K·(3·576+2·512); `useful` = the
share of slots that hold a key under the causal mask (Σ_t min(t+1, K) / (S·K)). Every sparse rate
comes both ways, `*useful_tflops` (valid slots only) first, then `*tflops` (all K slots): `rates`.
Dense: SDPA causal, bf16, [1, H, S, 256] q/k/v (H = --dense-heads, default 64), as SDPA chooses ("auto")
and pinned to each fused backend (flash = FlashAttention-2, cudnn, efficient); FLOPs for the causal half only:
fwd 2·S²·H·D (QKᵀ and PV, half the S² pairs), bwd 2.5 × fwd.
bwd_parts: the backward's variants on their own (with and without the dKV adds, the adds alone,
the slots in ascending key order); --bwd-tp P,… repeats them per token-parallel rank's rows.
Timings: median of CUDA-event times after warm-up; spread = max − min.
"""

import argparse
import functools
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if "glm5_bridge" not in sys.modules:  # load glm5_bridge.kernels without the model stack's __init__
    pkg = types.ModuleType("glm5_bridge")
    pkg.__path__ = [str(ROOT / "glm5_bridge")]
    sys.modules["glm5_bridge"] = pkg

from glm5_bridge.kernels import ops as iface  # noqa: E402
from timing import SDPA_BACKENDS, dense_attention, sdpa_choice, times_ms  # noqa: E402  (benchmarks/timing.py)

from glm5_bridge.kernels import slot_union  # noqa: E402
from glm5_bridge.kernels import sparse_mla_bwd as ours_bwd  # noqa: E402
from glm5_bridge.kernels import sparse_mla_fwd as ours_fwd  # noqa: E402

TOPK, SCALE = 2048, 1 / 16
ROWS = []
OUT_PATH = None


def emit(kind, **row):
    row = {"kind": kind, **row}
    ROWS.append(row)
    print("RESULT " + json.dumps(row), flush=True)
    if OUT_PATH:
        with open(OUT_PATH, "w") as f:
            json.dump(ROWS, f, indent=1)


def rows_of(kind, **match):
    """This run's rows of `kind` whose fields equal `match`, in order."""
    return [r for r in ROWS if r["kind"] == kind and all(r.get(k) == v for k, v in match.items())]


def pick(kind, **match):
    """The first of rows_of(kind, **match) (None if none)."""
    return next(iter(rows_of(kind, **match)), None)


def median_ms(fn, reps, warmup=2):
    """(median, max − min) in ms."""
    t = times_ms(fn, reps, warmup)
    return statistics.median(t), max(t) - min(t)


def causal_topk(lengths, k, gen):
    """[T, k] int32 flat indices: each query draws min(k, visible) distinct keys of its own causal
    window, −1 elsewhere, slots shuffled (−1 interleaved)."""
    total = sum(lengths)
    out = torch.full((total, k), -1, dtype=torch.int32, device="cuda")
    start = 0
    for n in lengths:
        for r0 in range(0, n, 1024):
            r1 = min(r0 + 1024, n)
            rows = torch.arange(r0, r1, device="cuda")
            score = torch.rand(r1 - r0, n, device="cuda", generator=gen)
            score = score.masked_fill(torch.arange(n, device="cuda")[None] > rows[:, None], -1.0)
            w = min(k, n)
            best, idx = score.topk(w, dim=-1)
            out[start + r0:start + r1, :w] = (idx + start).masked_fill(best < 0, -1).int()
        start += n
    perm = torch.randperm(k, device="cuda", generator=gen)
    return out[:, perm].contiguous()


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def useful_share(idx):
    """The share of a [T, K] top-k's slots that hold a key (−1: none): the valid slots' FLOPs over
    all K slots' (1 − the empty slots of queries that see fewer than K keys)."""
    return int((idx >= 0).sum()) / idx.numel()


def rates(flop, ms, useful, prefix=""):
    """TFLOP/s both ways (issue 39's target 6), the useful first: `{prefix}useful_tflops` counts the
    slots that hold a key (useful · flop), `{prefix}tflops` all K slots (flop)."""
    return {f"{prefix}useful_tflops": round(useful * flop / ms / 1e9, 1), f"{prefix}tflops": round(flop / ms / 1e9, 1)}


def pad_heads(x, heads):
    """[T, H, D] → [T, heads, D], the extra heads zero: the autograd path's padding."""
    return iface._pad_heads(x, heads)[0]


def sparse_flops(s, heads):
    """(fwd, bwd) FLOPs of sparse MLA over all TOPK slots: 2·S·H·K·(576+512), 2·S·H·K·(3·576+2·512)."""
    return 2 * s * heads * TOPK * (576 + 512), 2 * s * heads * TOPK * (3 * 576 + 2 * 512)


def upstream_mods():
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_sparse_mla_bwd as bwd_mod
    from megatron.core.transformer.experimental_attention_variant.ops import tilelang_sparse_mla_fwd as fwd_mod

    return fwd_mod, bwd_mod


def upstream_calls(fwd_mod, bwd_mod, q, kv, dout, idx):
    """megatron-core's kernels called directly (4-D layout): (fwd, bwd from the fwd's lse, O of the
    real heads). Below 16 heads on heads zero-padded to 16, as the autograd path pads them (its
    backward's head tiles are unguarded)."""
    s, heads = q.shape[:2]
    hu = iface.kernel_heads(heads, iface.UPSTREAM_MIN_HEADS)
    q4, kv4, idx4 = pad_heads(q, hu).view(1, s, hu, 576), kv.view(1, s, 1, 576), idx.view(1, s, 1, TOPK)
    do4 = pad_heads(dout, hu).view(1, s, hu, 512)

    def fwd():
        return fwd_mod.sparse_mla_fwd_interface(q4, kv4, idx4, sm_scale=SCALE, d_v=512)

    o, lse = fwd()

    def bwd():
        delta = bwd_mod.sparse_mla_delta(o, do4)
        return bwd_mod.sparse_mla_bwd(q4, kv4, None, do4, idx4, lse, sm_scale=SCALE, delta=delta)

    return fwd, bwd, o[0, :, :heads]


def ours_calls(q, kv, dout, idx, kernel_heads=None):
    """Our kernels called directly, as SparseMLA calls them: (fwd, bwd from the fwd's lse, O of
    the real heads); `kernel_heads` > H runs them on heads zero-padded to that many. The active
    slot count (SparseMLA gets it from kernel_indices) is computed here, outside the timings."""
    s, heads = q.shape[:2]
    hk = kernel_heads or heads
    qk, dk = pad_heads(q, hk), pad_heads(dout, hk)
    n = ours_fwd.active_slots(idx)
    ops = iface.ours_ops()

    def fwd():
        return ours_fwd.fwd(qk, kv, idx, SCALE, n)

    o, lse = fwd()

    def bwd():
        return ops.bwd(qk.view(1, s, hk, 576), kv.view(1, s, 1, 576), o.view(1, s, hk, 512),
                       dk.view(1, s, hk, 512), idx.view(1, s, 1, TOPK), lse.view(1, s, hk), SCALE, n)

    return fwd, bwd, o[:, :heads]


# ---------------------------------------------------------------------------------------------- checks
def check_fwd():
    """Our forward vs the fp32 torch reference (kernels/sparse_mla_fwd.fwd_reference), on the slots
    as drawn and used-first, and the non-skipping build."""
    cases = [([1, 63, 1000, 130], 64), ([777], 16), ([4096, 2500, 1700], 64), ([300, 5], 128)]
    ok = True
    for lengths, heads in cases:
        gen = torch.Generator(device="cuda").manual_seed(sum(lengths) + heads)
        total = sum(lengths)
        q = torch.randn(total, heads, 576, device="cuda", generator=gen).bfloat16()
        kv = torch.randn(total, 576, device="cuda", generator=gen).bfloat16()
        idx = causal_topk(lengths, TOPK, gen)
        idx[min(3, total - 1)] = -1  # one all-empty row
        rows = torch.randperm(total, device="cuda", generator=gen)[:384].sort().values
        rows = torch.unique(torch.cat([rows, torch.tensor([0, min(3, total - 1)], device="cuda")]))
        ref_o, ref_l = ours_fwd.fwd_reference(q[rows], kv, idx[rows], SCALE)
        runs = {"used_first": lambda: ours_fwd.fwd(q, kv, used_first(idx), SCALE),
                "interleaved": lambda: ours_fwd.fwd(q, kv, idx, SCALE),
                "noskip": lambda: simple_fwd(heads, skip_empty=False)(q, kv, idx, ours_fwd.active_slots(idx))}
        for name, run in runs.items():
            try:
                o, lse = run()
                torch.cuda.synchronize()
                eo, el = rel(o[rows], ref_o), rel(lse[rows], ref_l)
                finite = bool(torch.isfinite(o).all() and torch.isfinite(lse).all())
                empty_zero = bool((o[min(3, total - 1)] == 0).all())
                good = finite and empty_zero and eo < 1e-2 and el < 1e-3
            except Exception as e:  # noqa: BLE001
                eo = el = float("nan")
                finite = empty_zero = good = False
                print(f"check {name} failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
            ok &= good
            emit("check_fwd", slots=name, lengths="+".join(map(str, lengths)), heads=heads, out_rel=eo,
                 lse_rel=el, finite=finite, empty_row_zero=empty_zero, passed=good)
    return ok


def used_first(idx):
    """The slots reordered as SparseMLA passes them to the kernels (used first, −1 after)."""
    return iface.kernel_indices(idx)[0][0, :, 0]


@functools.cache
def simple_fwd(heads, group=1, skip_empty=True):
    """simple_kernel as a forward (q, kv, idx, cnt) → (out, lse), the benchmark's baselines:
    skip_empty=False walks every top-k block (2-stage pipeline: the pre-skipping kernel); group 1
    runs one token per CTA (below 64 heads: the kernel before token groups), token_group(heads)
    simple_kernel over token groups (what fwd() ran below 64 heads before the seesaw took them)."""
    kernel = ours_fwd.simple_kernel(heads, TOPK, SCALE, skip_empty=skip_empty, group=group)
    return functools.partial(ours_fwd.fwd_call, kernel, group)


def check_bwd_ours(heads=64, lengths=(1, 63, 1000, 130)):
    """Our ops through SparseMLA (fwd + bwd) vs the fp32 reference ops (kernels/reference.py)."""
    from glm5_bridge.kernels import reference

    gen = torch.Generator(device="cuda").manual_seed(7)
    total = sum(lengths)
    q = torch.randn(total, heads, 576, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(total, 576, device="cuda", generator=gen).bfloat16()
    idx = causal_topk(list(lengths), TOPK, gen).long()
    dout = torch.randn(total, heads, 512, device="cuda", generator=gen).bfloat16()
    res = {}
    for name, ops in (("ours", iface.ours_ops()), ("ref", reference.OPS)):
        q_, kv_ = q.clone().requires_grad_(), kv.clone().requires_grad_()
        out = iface.SparseMLA.apply(q_, kv_, idx, SCALE, ops)
        out.backward(dout)
        res[name] = (out.detach(), q_.grad, kv_.grad)
    errs = [rel(a, b) for a, b in zip(res["ours"], res["ref"])]
    good = all(e < 1e-2 for e in errs)
    emit("check_iface_ours", heads=heads, lengths="+".join(map(str, lengths)), out_rel=errs[0], dq_rel=errs[1],
         dkv_rel=errs[2], passed=good)
    return good


# ---------------------------------------------------------------------------------------------- sparse
def bench_sparse(seqs, heads_list, reps):
    fwd_mod, bwd_mod = upstream_mods()
    for s in seqs:
        for heads in heads_list:
            gen = torch.Generator(device="cuda").manual_seed(s + heads)
            q = torch.randn(s, heads, 576, device="cuda", generator=gen).bfloat16()
            kv = torch.randn(s, 576, device="cuda", generator=gen).bfloat16()
            idx_drawn = causal_topk([s], TOPK, gen)
            idx = used_first(idx_drawn)
            dout = torch.randn(s, heads, 512, device="cuda", generator=gen).bfloat16()
            useful = useful_share(idx)  # Σ_t min(t + 1, K) / (S·K): causal_topk fills every visible key up to K
            f_fl, b_fl = sparse_flops(s, heads)
            base = dict(S=s, H=heads, topk=TOPK, useful=round(useful, 4), fwd_gflop=f_fl / 1e9, bwd_gflop=b_fl / 1e9)

            def row(impl, fwd_ms=None, fwd_sp=None, bwd_ms=None, bwd_sp=None, **extra):
                r = dict(impl=impl, **base, **extra)
                if fwd_ms is not None:
                    r.update(fwd_ms=round(fwd_ms, 3), fwd_spread_ms=round(fwd_sp, 3), **rates(f_fl, fwd_ms, useful, "fwd_"))
                if bwd_ms is not None:
                    r.update(bwd_ms=round(bwd_ms, 3), bwd_spread_ms=round(bwd_sp, 3), **rates(b_fl, bwd_ms, useful, "bwd_"))
                emit("sparse_mla", **r)

            uf, ub, o_up = upstream_calls(fwd_mod, bwd_mod, q, kv, dout, idx)
            tf, sf = median_ms(uf, reps)
            tb, sb = median_ms(ub, max(3, reps // 2))
            row("upstream", tf, sf, tb, sb)

            # ours on the used-first slots and on the slots as drawn; below 16 heads also with the
            # heads zero-padded to 16 (what the autograd path ran before 8 heads ran as groups of 8)
            runs = [("ours", idx, heads), ("ours_interleaved", idx_drawn, heads)]
            runs += [("ours_padded16", idx, 16)] if heads < 16 else []
            for name, ix, hk in runs:
                of, ob, o_ours = ours_calls(q, kv, dout, ix, hk)
                tf, sf = median_ms(of, reps)
                tb, sb = median_ms(ob, max(3, reps // 2))
                row(name, tf, sf, tb, sb, out_vs_upstream=rel(o_ours, o_up))
            if heads >= 16:  # one token per CTA (the baselines below) needs 16-row tiles
                cnt = ours_fwd.active_slots(idx_drawn)
                nf = lambda: simple_fwd(heads, skip_empty=False)(q, kv, idx_drawn, cnt)  # noqa: E731
                tf, sf = median_ms(nf, reps)
                row("ours_fwd_noskip", tf, sf, out_vs_upstream=rel(nf()[0], o_up))
            if slot_union.token_group(heads) > 1 and heads >= 16:  # token groups against one token per CTA
                cnt = ours_fwd.active_slots(idx)
                for name, group in (("ours_fwd_per_token", 1), ("ours_fwd_simple_groups", slot_union.token_group(heads))):
                    pf = lambda g=group: simple_fwd(heads, g)(q, kv, idx, cnt)  # noqa: E731
                    tf, sf = median_ms(pf, reps)
                    row(name, tf, sf, out_vs_upstream=rel(pf()[0], o_up))

            # the autograd path the model runs (default ops), fwd and fwd+bwd
            qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()

            def iff():
                with torch.no_grad():
                    iface.sparse_mla(qg, kvg, idx_drawn, SCALE)

            def ifb():
                qg.grad = kvg.grad = None
                iface.sparse_mla(qg, kvg, idx_drawn, SCALE).backward(dout)

            for kern in ("upstream", "ours"):
                os.environ[iface.KERNELS_ENV] = kern
                try:
                    tf, sf = median_ms(iff, reps)
                    tfb, sfb = median_ms(ifb, max(3, reps // 2))
                    row(f"iface[{kern}]", tf, sf, tfb - tf, sfb)
                except Exception as e:  # noqa: BLE001
                    print(f"iface[{kern}] S={s} H={heads}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                finally:
                    os.environ.pop(iface.KERNELS_ENV, None)

            # torch reference math in bf16 (gather + einsum), fwd only, chunked
            if heads == 64 and s <= 8192:
                def tref():
                    with torch.no_grad():
                        for r0 in range(0, s, 512):
                            i = idx[r0:r0 + 512].long()
                            keys = kv[i.clamp(min=0)]
                            sc = torch.einsum("thd,tkd->thk", q[r0:r0 + 512], keys).float() * SCALE
                            sc = sc.masked_fill((i < 0)[:, None], float("-inf")).softmax(-1)
                            torch.einsum("thk,tkc->thc", sc.bfloat16(), keys[..., :512])

                tf, sf = median_ms(tref, 3, warmup=1)
                row("torch_bf16_chunked", tf, sf)
            del q, kv, idx, idx_drawn, dout, qg, kvg
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- bwd parts
def bwd_variants(heads=64):
    """name → a backward run (q, kv, dout, idx, cnt, lse, delta) → (dq, dkv), delta precomputed.
    "fused" is what bwd() runs (below 64 heads: token groups, slot_union.token_group);
    "fused_no_adds" the same without the dKV atomic adds (their cost; wrong dkv); "adds_only" the
    per-token kernel's adds alone (sparse_mla_bwd.dkv_adds_kernel: the floor they put under it);
    below 64 heads also "fused_per_token" (one token per CTA: the kernel before token groups; at 16 heads
    two CTAs per SM) and "fused_torch_union" (token groups, their union from the torch sort instead
    of slot_union's map kernel, which bwd() runs on the GPU; "fused_map_union" in older result
    files, when the sort was the default). The two-kernel split these were once compared with is
    in older result files ("split"; benchmarks/LOG.md)."""
    group = slot_union.token_group(heads)
    variants = {"fused": (ours_bwd.get_fused_kernel(heads, TOPK, SCALE, "bfloat16"), group),
                "fused_no_adds": (ours_bwd.fused_kernel(heads, TOPK, SCALE, "bfloat16", adds=False), group)}
    if group > 1 and heads >= 16:  # one token per CTA needs 16-row tiles
        variants["fused_per_token"] = (ours_bwd.fused_kernel(heads, TOPK, SCALE, "bfloat16", group=1), 1)
    adds = ours_bwd.dkv_adds_kernel(TOPK)

    def adds_only(q, kv, dout, idx, cnt, lse, delta):
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device="cuda")
        adds(idx, cnt, dkv)
        # dq: a zero view, nothing written (runs up to BV returned zeros_like(q): a 0.6-GB memset at
        # 8K × 64 heads inside the adds' ~10.7 ms, about 0.2 ms at 3 TB/s by estimate)
        return torch.zeros((), dtype=q.dtype, device=q.device).expand(q.shape), dkv

    def one_pass(kernel, group, union=slot_union.union_slots):
        return lambda *args: ours_bwd.fused_call(kernel, group, *args, union=union)

    runs = {name: one_pass(*kg) for name, kg in variants.items()}
    if group > 1:
        runs["fused_torch_union"] = one_pass(*variants["fused"], slot_union.union_slots_reference)
    return {**runs, "adds_only": adds_only}


def ascending_slots(idx):
    """[T, K] top-k → the same sets with each row's keys in ascending order, −1 slots last: close to
    the order our radix select writes them (radix_topk: columns in ascending 512-column passes),
    where the benchmark's draws come in random order. In ascending order the CTAs of neighbouring
    queries walk the same key ranges at the same time, so their dKV adds may meet on the same rows
    (runs BK–BL's sticky top-k, slots in place, showed no cost at 64 heads; this measures it)."""
    big = torch.iinfo(idx.dtype).max
    keys = torch.where(idx < 0, big, idx).sort(dim=1).values
    return torch.where(keys == big, -1, keys)


def rank_rows(s, parts):
    """The query rows [a, b) each of `parts` token-parallel ranks attends at one sequence of s tokens
    (attention/topk.row_bounds at token_parallel.QUERY_COST_KEYS, as attend() splits them)."""
    from glm5_bridge.model.attention import token_parallel
    from glm5_bridge.model.attention.topk import row_bounds

    bounds = row_bounds((s,), parts, cap=TOPK, query_cost=token_parallel.QUERY_COST_KEYS)
    return list(zip(bounds[:-1], bounds[1:]))


def bench_bwd_parts(seqs, heads_list, reps=5, tps=()):
    """Our backward kernels on their own (delta precomputed, dkv zeroing included), per variant;
    "fused_ascending_slots" is "fused" on the same top-k in ascending key order (ascending_slots).
    tps: also per token-parallel rank of each P (its rank_rows, all heads, the whole kv), the
    variants that split its time: fused, fused_no_adds, adds_only, fused_ascending_slots
    (`bwd_parts_rank` rows) — which of a rank's backward the dKV adds take."""
    for heads in heads_list:
        variants = bwd_variants(heads)
        for s in seqs:
            gen = torch.Generator(device="cuda").manual_seed(s)
            q = torch.randn(s, heads, 576, device="cuda", generator=gen).bfloat16()
            kv = torch.randn(s, 576, device="cuda", generator=gen).bfloat16()
            idx = used_first(causal_topk([s], TOPK, gen))
            cnt = ours_fwd.active_slots(idx)
            dout = torch.randn(s, heads, 512, device="cuda", generator=gen).bfloat16()
            out, lse = ours_fwd.fwd(q, kv, idx, SCALE, cnt)
            delta = (out.float() * dout.float()).sum(-1)
            add_gb = int((idx >= 0).sum()) * 576 * 4 / 1e9  # fp32 dKV bytes the per-token adds move
            useful = useful_share(idx)  # the same for every slot order below
            group = slot_union.token_group(heads)
            group_add_gb = add_gb  # the same for token groups: one row per distinct key of a group
            if group > 1:
                group_rows = int(slot_union.union_slots_reference(idx, group)[2].sum())
                group_add_gb = group_rows * 576 * 4 / 1e9
            ref = None
            for name, run in variants.items():
                args = (q, kv, dout, idx, cnt, lse, delta)
                t, spread = median_ms(lambda: run(*args), reps)
                dq, dkv = run(*args)
                ref = ref or (dq, dkv)
                emit("bwd_parts", variant=name, S=s, H=heads, ms=round(t, 3), spread=round(spread, 3),
                     dq_vs_fused=rel(dq, ref[0]), dkv_vs_fused=rel(dkv, ref[1]),
                     **rates(sparse_flops(s, heads)[1], t, useful),
                     add_gb=round(add_gb, 2), add_tb_per_s=round(add_gb / t, 2), group_add_gb=round(group_add_gb, 2))
                del dq, dkv
            ascending = ascending_slots(idx)
            args = (q, kv, dout, ascending, ours_fwd.active_slots(ascending), lse, delta)
            t, spread = median_ms(lambda: variants["fused"](*args), reps)
            dq, dkv = variants["fused"](*args)
            emit("bwd_parts", variant="fused_ascending_slots", S=s, H=heads, ms=round(t, 3), spread=round(spread, 3),
                 dq_vs_fused=rel(dq, ref[0]), dkv_vs_fused=rel(dkv, ref[1]),
                 **rates(sparse_flops(s, heads)[1], t, useful))
            del dq, dkv
            for parts in tps:
                for rank, (a, b) in enumerate(rank_rows(s, parts)):
                    if b == a:
                        continue
                    rows = slice(a, b)
                    selected, rank_useful = int((idx[rows] >= 0).sum()), useful_share(idx[rows])  # any order
                    for name, slots in (("fused", idx), ("fused_no_adds", idx), ("adds_only", idx),
                                        ("fused_ascending_slots", ascending)):
                        run = variants["fused" if name == "fused_ascending_slots" else name]
                        mine = slots[rows]
                        args = (q[rows], kv, dout[rows], mine, ours_fwd.active_slots(mine), lse[rows], delta[rows])
                        t, spread = median_ms(lambda: run(*args), reps)
                        emit("bwd_parts_rank", variant=name, S=s, H=heads, tp=parts, rank=rank, rows=b - a,
                             selected=selected, ms=round(t, 3), spread=round(spread, 3),
                             **rates(sparse_flops(b - a, heads)[1], t, rank_useful))
            if group > 1:  # the token groups' union alone (in "fused" and "fused_torch_union")
                for name, union in (("union_slots_map_kernel", slot_union.union_slots_kernel),
                                    ("union_slots_torch", slot_union.union_slots_reference)):
                    t, spread = median_ms(lambda: union(idx, group), reps)
                    emit("bwd_parts", variant=name, S=s, H=heads, ms=round(t, 3), spread=round(spread, 3))
            del q, kv, idx, cnt, dout, out, lse, delta, ref, ascending
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- indexer
def bench_indexer(seqs, heads=32, dim=128, reps=5):
    from megatron.core.transformer.experimental_attention_variant.ops.tilelang_indexer_fwd import indexer_fwd_interface

    for s in seqs:
        gen = torch.Generator(device="cuda").manual_seed(s)
        iq = torch.randn(s, heads, dim, device="cuda", generator=gen).bfloat16()
        ik = torch.randn(s, dim, device="cuda", generator=gen).bfloat16()
        w = torch.randn(s, heads, device="cuda", generator=gen) * (heads ** -0.5 * dim ** -0.5)
        ks = torch.zeros(s, dtype=torch.int32, device="cuda")
        ke = torch.arange(1, s + 1, dtype=torch.int32, device="cuda")

        def up():
            logits = indexer_fwd_interface(iq, ik, w, ks, ke)
            return logits.topk(TOPK, dim=-1, sorted=False)

        def tref():  # attention/topk.select_topk's math: 2048-row chunks of fp32 [rows, S] scores
            out = torch.empty(s, TOPK, dtype=torch.int64, device="cuda")
            keys = torch.arange(s, device="cuda")
            for r0 in range(0, s, 2048):
                r1 = min(r0 + 2048, s)
                sc = torch.einsum("rhd,sd->rhs", iq[r0:r1].float(), ik.float()).relu_()
                sc = torch.einsum("rhs,rh->rs", sc, w[r0:r1])
                sc = sc.masked_fill(keys[None] > keys[r0:r1, None], float("-inf"))
                out[r0:r1] = sc.topk(TOPK, dim=-1).indices
            return out

        from glm5_bridge.kernels import indexer as ours_indexer

        starts = torch.zeros(s, dtype=torch.int64, device="cuda")

        def ours(**kw):  # our score kernel over causal key windows + our radix select, row blocks as planned
            return ours_indexer.select_topk(iq, ik, w, starts, TOPK, **kw)

        def ours_torch_topk():  # the same with torch.topk as the selection
            return ours_indexer.select_topk(iq, ik, w, starts, TOPK, select=ours_indexer.torch_select)

        def ours_scores_only():  # the score blocks alone: what the selection costs is the difference
            for r0, r1, w0 in ours_indexer.row_blocks(starts, 0, s):  # one host read, as select_topk
                ours_indexer.block_scores(iq, ik, w, starts, r0, r1, w0=w0)

        same = (ours().sort(1).values == ours_torch_topk().sort(1).values).all(1).float().mean().item()
        emit("indexer_check", S=s, rows_identical_radix_vs_torch_topk=round(same, 6),
             **fp32_agreement(iq, ik, w, ours()))
        # the score block's byte budget (indexer.BLOCK_BYTES is the default); "rows4096" is the
        # blocking before the budget: 4096 rows a block, whatever the window
        variants = [("ours", ours, reps), ("ours_rows4096", lambda: ours(block_bytes=1 << 40), reps)]
        variants += [(f"ours_budget{mib}MiB", lambda mib=mib: ours(block_bytes=mib << 20), reps)
                     for mib in (16, 32, 128) if mib << 20 != ours_indexer.BLOCK_BYTES]
        variants += [("ours_torch_topk", ours_torch_topk, reps), ("ours_scores_only", ours_scores_only, reps),
                     ("upstream_tilelang+torch.topk", up, reps), ("torch_chunked", tref, 2)]
        for name, fn, n in variants:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                t, sp = median_ms(fn, n, warmup=1)
            except torch.OutOfMemoryError:
                emit("indexer", impl=name, S=s, error="out of memory")
                continue
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            emit("indexer", impl=name, S=s, heads=heads, dim=dim, topk=TOPK, ms=round(t, 3), spread_ms=round(sp, 3),
                 peak_extra_gib=round(peak, 3), score_gflop=2 * s * s / 2 * heads * dim / 1e9,
                 **({"block_bytes": ours_indexer.BLOCK_BYTES} if name == "ours" else {}))


def fp32_agreement(iq, ik, w, picked, rows=2048, tie_rel=1e-6, topk=TOPK):
    """Our top-k (causal, one sequence) against the fp32 reference's, row by row: the share of rows
    with the same set, and the rows that differ by more than an exact tie — a key only one side
    picked whose fp32 reference score differs from the other side's swapped key's by more than
    tie_rel of the row's largest |score| (a pure tie differs by 0; summation order, ~1e-7)."""
    from glm5_bridge.kernels.reference import index_scores

    s, dev = ik.shape[0], ik.device
    keys = torch.arange(s, device=dev)
    same = beyond_ties = 0
    worst = 0.0
    for r0 in range(0, s, rows):
        r1 = min(r0 + rows, s)
        sc = index_scores(iq[r0:r1], ik, w[r0:r1]).masked_fill(keys[None] > keys[r0:r1, None], float("-inf"))
        ref = sc.topk(topk, dim=-1).indices
        ref = ref.masked_fill(sc.gather(1, ref) == float("-inf"), -1).sort(1).values
        ours = picked[r0:r1].sort(1).values
        eq = (ours == ref).all(1)
        same += int(eq.sum())
        for i in (~eq).nonzero().flatten().tolist():
            a, b = set(ours[i].tolist()) - {-1}, set(ref[i].tolist()) - {-1}
            row = sc[i]
            only_ours = row[torch.tensor(sorted(a - b), device=dev, dtype=torch.long)]
            only_ref = row[torch.tensor(sorted(b - a), device=dev, dtype=torch.long)]
            gap = (only_ref.max() - only_ours.min()).item() if len(only_ours) and len(only_ref) else float("inf")
            scale = row[row > float("-inf")].abs().max().item()
            worst = max(worst, gap / scale)
            beyond_ties += gap > tie_rel * scale
    return dict(rows_identical_vs_fp32=round(same / s, 6), rows_beyond_ties_vs_fp32=beyond_ties,
                worst_swap_gap_rel=float(f"{worst:.3g}"), tie_rel=tie_rel)


# ---------------------------------------------------------------------------------------------- compile
def bench_compile(heads=64, n=20):
    """Kernel builds and per-call wall time over n random packed lengths (warm-up = first call)."""
    fwd_mod, bwd_mod = upstream_mods()
    gen = torch.Generator(device="cuda").manual_seed(3)
    lengths = [int(x) for x in torch.randint(300, 12000, (n,), generator=gen, device="cuda").tolist()]
    def ours_builds():
        return sum(f.cache_info().misses for f in (ours_fwd.get_kernel, ours_bwd.get_fused_kernel,
                                                   ours_bwd.get_delta_kernel, slot_union.get_union_kernel))

    def upstream_builds():
        return len(fwd_mod._tilelang_sparse_mla_fwd_kernel_cache) + len(bwd_mod._tilelang_sparse_mla_bwd_kernel_cache)

    for impl in ("ours_fwd", "ours_fwd_bwd", "upstream_fwd", "upstream_fwd_bwd"):
        builds0 = ours_builds() if impl.startswith("ours") else upstream_builds()
        times = []
        t_all = time.time()
        for s in lengths:
            q = torch.randn(s, heads, 576, device="cuda").bfloat16()
            kv = torch.randn(s, 576, device="cuda").bfloat16()
            idx = causal_topk([s], TOPK, gen)
            torch.cuda.synchronize()
            t0 = time.time()
            if impl.startswith("ours"):
                o, lse = ours_fwd.fwd(q, kv, idx, SCALE)
                if impl == "ours_fwd_bwd":
                    ours_bwd.bwd(q, kv, o, torch.randn_like(o), idx, lse, SCALE)
            else:
                o, lse = fwd_mod.sparse_mla_fwd_interface(q[None], kv[None, :, None], idx[None, :, None],
                                                          sm_scale=SCALE, d_v=512)
                if impl == "upstream_fwd_bwd":
                    bwd_mod.sparse_mla_bwd(q[None], kv[None, :, None], o, torch.randn_like(o), idx[None, :, None],
                                           lse, sm_scale=SCALE)
            torch.cuda.synchronize()
            times.append(time.time() - t0)
        builds = (ours_builds() if impl.startswith("ours") else upstream_builds()) - builds0
        emit("compile", impl=impl, lengths=lengths, kernel_builds=builds,
             first_call_s=round(times[0], 2), later_max_s=round(max(times[1:]), 3),
             later_median_s=round(statistics.median(times[1:]), 4), total_s=round(time.time() - t_all, 1))


# ---------------------------------------------------------------------------------------------- dense
def bench_dense(seqs, heads=64, dim=256, reps=10):
    """SDPA's own choice ("auto", the bar the headline's below_dense uses), then each fused backend
    pinned: the issue's 30 ms at 8K was measured on a slower one than torch 2.11 picks on Hopper."""
    for s in seqs:
        picked = sdpa_choice(s, heads, dim)
        for backend in (None, *SDPA_BACKENDS):
            f, fb = dense_attention(s, heads, dim, backend=backend)
            try:
                tf, sf = median_ms(f, reps)
                tfb, sfb = median_ms(fb, reps)
            except RuntimeError as e:  # a backend that does not take these shapes on this GPU
                print(f"dense {backend} S={s} H={heads}: {str(e).splitlines()[0][:200]}", flush=True)
                continue
            finally:
                del f, fb
                torch.cuda.empty_cache()
            fl = 2 * s * s * heads * dim  # causal half of 4·S²·H·D
            emit("dense_sdpa", S=s, H=heads, D=dim, backend=backend or "auto",
                 **({"picks": picked} if backend is None else {}),
                 fwd_ms=round(tf, 3), bwd_ms=round(tfb - tf, 3), fwd_bwd_ms=round(tfb, 3), fwd_tflops=round(fl / tf / 1e9, 1),
                 bwd_tflops=round(2.5 * fl / (tfb - tf) / 1e9, 1), spread_ms=round(sfb, 3))


def headline():
    """The issue's headline from this run's rows, where all parts ran: per S (and per head count
    with a dense row at it: 64 is the issue's, fewer are one rank's share under TP), our indexer
    (scores + top-k, 32 heads whatever H) + our sparse-MLA fwd + bwd (raw kernels on used-first
    slots, the bwd with its delta kernel) against dense SDPA fwd + bwd at the same H: `below_dense`
    against SDPA's own choice, and the total of every pinned backend that ran."""
    for sparse in rows_of("sparse_mla", impl="ours"):
        s, h = sparse["S"], sparse["H"]
        index, dense = pick("indexer", impl="ours", S=s), pick("dense_sdpa", S=s, H=h, backend="auto")
        if index is None or dense is None or "bwd_ms" not in sparse:
            continue
        total = index["ms"] + sparse["fwd_ms"] + sparse["bwd_ms"]
        pinned = {b: r["fwd_bwd_ms"] for b in SDPA_BACKENDS if (r := pick("dense_sdpa", S=s, H=h, backend=b))}
        emit("headline", S=s, H=h, indexer_ms=index["ms"], fwd_ms=sparse["fwd_ms"], bwd_ms=sparse["bwd_ms"],
             total_ms=round(total, 2), dense_fwd_bwd_ms=dense["fwd_bwd_ms"], dense_picks=dense.get("picks"),
             below_dense=total < dense["fwd_bwd_ms"], dense_pinned_fwd_bwd_ms=pinned,
             below_pinned={b: total < ms for b, ms in pinned.items()})


# ---------------------------------------------------------------------------------------------- tp
def bench_tp_ranks(seqs, tps, reps, device="cuda"):
    """What one tensor-parallel rank runs (the issue's target 3), every rank of each P played in turn
    on this GPU (bench_tp.py's --emulate: torch's fake process group, no wire): our sparse MLA fwd +
    bwd on the "tilelang" backend, heads split (megatron's layout: 64/P heads over all tokens) and
    tokens split (attention/token_parallel: 64 heads over the rank's row_bounds range; the kernels
    on ops' transposed copies of the head-blocked rows, and in place: "tokens_split_in_place"). One
    `tp_attention` row per (S, P, rank, layout), one `tp_check` per (S, P, rank). P = 1 runs first:
    the whole attention (64 heads, every row) timed as the ranks are (bench_tp.BACK_TO_BACK), the
    per-rank efficiency's one-GPU figure."""
    import bench_tp

    for parts, rank, group in bench_tp.each_fake_rank([1, *(p for p in tps if p != 1)]):
        for s in seqs:
            for row in bench_tp.bench_attention(s, device, group, reps, baseline=True):
                kind = "tp_attention" if row["part"] == "attention" else "tp_check"
                emit(kind, tp=parts, rank=rank, **{k: v for k, v in row.items() if k != "part"})


def targets():
    """One `target` row per target of issue 39 that this run's rows can answer, each with the
    figures it compares, the bar and met true/false (rows it needs but did not run: skipped)."""
    def emit_target(name, value, bar, met, **figures):
        emit("target", target=name, value=value, bar=bar, met=bool(met), **figures)

    for s, ratio in ((8192, 1.0), (16384, 0.6)):  # 1. indexer + fwd + bwd against dense SDPA fwd + bwd
        h = pick("headline", S=s, H=64)
        if h:
            emit_target(f"1_headline_{s // 1024}K", round(h["total_ms"] / h["dense_fwd_bwd_ms"], 3), ratio,
                        h["total_ms"] <= ratio * h["dense_fwd_bwd_ms"], total_ms=h["total_ms"],
                        dense_fwd_bwd_ms=h["dense_fwd_bwd_ms"], dense_picks=h.get("dense_picks"))
    ours64 = pick("sparse_mla", impl="ours", S=8192, H=64)
    if ours64 and "bwd_ms" in ours64:  # 2. useful TFLOP/s at 8K × 64 heads
        emit_target("2_fwd_useful_tflops_8K_64h", ours64["fwd_useful_tflops"], 620, ours64["fwd_useful_tflops"] >= 620,
                    all_slots_tflops=ours64["fwd_tflops"], fwd_ms=ours64["fwd_ms"])
        emit_target("2_bwd_useful_tflops_8K_64h", ours64["bwd_useful_tflops"], 450, ours64["bwd_useful_tflops"] >= 450,
                    all_slots_tflops=ours64["bwd_tflops"], bwd_ms=ours64["bwd_ms"])
    # 3. per-rank efficiency at TP P: (one GPU's 64-head fwd + bwd) / (P × slowest rank's), through the
    # same backend path and timed the same way (the P = 1 row; without it, sparse's iface[ours] row)
    for s, parts in sorted({(r["S"], r["tp"]) for r in rows_of("tp_attention") if r["tp"] > 1}):
        same_timing = pick("tp_attention", S=s, tp=1, impl="heads_split")
        full = pick("sparse_mla", impl="iface[ours]", S=s, H=64)
        iface_ms = round(full["fwd_ms"] + full["bwd_ms"], 3) if full and "bwd_ms" in full else None
        if same_timing:
            one_gpu, one_gpu_from = same_timing["fwd_bwd_ms"], "tp1_heads_split_back_to_back"
        elif iface_ms is not None:
            one_gpu, one_gpu_from = iface_ms, "sparse_iface_ours"
        else:
            continue
        layouts = {}
        for impl in ("heads_split", "tokens_split", "tokens_split_in_place"):
            got = [r["fwd_bwd_ms"] for r in rows_of("tp_attention", S=s, tp=parts, impl=impl)]
            if len(got) == parts:
                layouts[impl] = dict(slowest_rank_ms=max(got), efficiency=round(one_gpu / (parts * max(got)), 3))
        if layouts:
            best = max(layouts, key=lambda k: layouts[k]["efficiency"])
            emit_target(f"3_tp{parts}_per_rank_efficiency_{s // 1024}K", layouts[best]["efficiency"], 0.8,
                        layouts[best]["efficiency"] >= 0.8, faster_layout=best, one_gpu_64h_fwd_bwd_ms=round(one_gpu, 3),
                        one_gpu_from=one_gpu_from,
                        sparse_iface_ours_fwd_bwd_ms=iface_ms,
                        layouts=layouts, note="compute only: the wire is not timed (fake process group)")
    idx, chk = pick("indexer", impl="ours", S=32768), pick("indexer_check", S=32768)
    if idx and "ms" in idx:  # 4. the indexer at 32K
        emit_target("4_indexer_32K_ms", idx["ms"], 10, idx["ms"] <= 10)
        emit_target("4_indexer_32K_extra_gib", idx["peak_extra_gib"], 0.6, idx["peak_extra_gib"] <= 0.6,
                    counts="peak allocated during the call minus before: the [T, 2048] int64 result and the score block")
    if chk and "rows_beyond_ties_vs_fp32" in chk:
        emit_target("4_indexer_32K_selection_vs_fp32", chk["rows_beyond_ties_vs_fp32"], 0, chk["rows_beyond_ties_vs_fp32"] == 0,
                    rows_identical=chk["rows_identical_vs_fp32"], worst_swap_gap_rel=chk["worst_swap_gap_rel"])
    comp = pick("compile", impl="ours_fwd_bwd")
    if comp:  # 5. no recompiles over 20 random lengths (the first call builds)
        emit_target("5_builds_over_20_lengths", comp["kernel_builds"], "fwd + bwd built once",
                    comp["kernel_builds"] <= 2, lengths=len(comp["lengths"]))


def main():
    global OUT_PATH
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="check,sparse,bwd_parts,indexer,compile,dense")
    ap.add_argument("--seqs", default="4096,8192,16384")
    ap.add_argument("--heads", default="16,64")
    ap.add_argument("--dense-heads", default="64", help="head counts of the dense bar (fewer: one TP rank's)")
    ap.add_argument("--indexer-seqs", default="8192,16384,32768")
    ap.add_argument("--tp", default="4,8", help="TP sizes the tp part plays, every rank on this GPU")
    ap.add_argument("--tp-seqs", default="8192")
    ap.add_argument("--bwd-tp", default="", help="P,...: bwd_parts also per token-parallel rank of each P")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "bench_dsa.json"))
    a = ap.parse_args()
    OUT_PATH = a.out
    parts = a.parts.split(",")
    print("device", torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    if "check" in parts:
        ok = check_fwd()
        print("forward checks passed" if ok else "FORWARD CHECK FAILED", flush=True)
        try:
            check_bwd_ours()
        except Exception as e:  # noqa: BLE001
            print(f"iface ours check failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
    if "sparse" in parts:
        bench_sparse([int(x) for x in a.seqs.split(",")], [int(x) for x in a.heads.split(",")], a.reps)
    if "bwd_parts" in parts:
        bench_bwd_parts([int(x) for x in a.seqs.split(",")], [int(x) for x in a.heads.split(",")],
                        tps=[int(x) for x in a.bwd_tp.split(",") if x])
    if "indexer" in parts:
        bench_indexer([int(x) for x in a.indexer_seqs.split(",")])
    if "compile" in parts:
        bench_compile()
    if "dense" in parts:
        for heads in [int(x) for x in a.dense_heads.split(",")]:
            bench_dense([int(x) for x in a.seqs.split(",")], heads)
    if "tp" in parts:
        bench_tp_ranks([int(x) for x in a.tp_seqs.split(",")], [int(x) for x in a.tp.split(",")], max(3, a.reps // 2))
    headline()
    targets()
    print("\n== summary ==")
    for r in ROWS:
        print(json.dumps({k: v for k, v in r.items() if k != "lengths"}))


if __name__ == "__main__":
    main()
