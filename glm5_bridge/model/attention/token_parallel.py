"""DSA sparse attention split by query tokens instead of heads under tensor parallelism
(`dsa_token_parallel` on the provider: True / False, or None, the default: on with the fused
backend under TP > 1 without context parallelism, where it was measured faster — `enabled`).

Megatron splits attention heads across the TP ranks. In absorbed MLA with DSA a token's heads share
one gathered 576-wide key row per selected key and one fp32 dKV row, so with heads split every rank
pays those per-key costs in full for 1/TP of the heads (benchmarks/LOG.md, run AU: at 8K a TP 8 rank's
sparse path took 8.6 ms where dense attention at its 8 heads took 2.3). Here each rank instead
attends all heads of 1/TP of the query tokens (runs AV–BA, every rank emulated on one H100: a TP 8
rank's attention fwd + bwd 3.8 / 7.5 ms at 8K / 16K against 6.8 / 20.2 with heads split, before the
all-to-alls' wire time):

    q [T, H/P, 576] (heads split) --all-to-all--> [P, rows, H/P, 576] (tokens split, head-blocked)
    backend(q rows, the full kv, their top-k rows) -> out [P, rows, H/P, 512]
    out --all-to-all--> [T, H/P, 512] (heads split again, for W_UV and o_proj)

Every rank already holds the full kv [T, 576] and the same top-k [T, K] (computed by the duplicated
kv_a path and the indexer). A rank's rows are one contiguous range (attention/topk.row_bounds,
equal min(p + 1, K) + QUERY_COST_KEYS work per range), so x goes out as it lies and comes back in
row order, and the backends take the rows as the all-to-all delivers them, block s from rank s
(its heads), the head-blocked layout of kernels/ops.py: no copy either way beyond the all-to-alls
(the fused kernels read and write it in place where ops.ours_take_head_blocks; otherwise ops makes
the head/row transposes this module made before). Gradients: the all-to-alls' backward is the
reverse all-to-all; each rank's dkv is a partial sum (its rows, all heads) where
with heads split it was another one (all rows, its heads); either way the ranks' partials add up
to dkv, which megatron's existing TP reduction of kv's gradient does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from glm5_bridge.model.attention.topk import row_bounds

# A query's fixed cost in the fused kernels (its q / dO / out / dq rows, its CTA's start and end),
# in selected keys' worth. Fitted with the head/row transposes around the kernels (run AZ: rank 0's
# 1916 rows at TP 8 took 0.44–0.47 ms longer than the others' 896 of the same key count, 290 keys a
# query; left out, rank 0 was the slowest rank by 13 %, run BR). With the kernels reading the
# all-to-all's rows in place the per-row copies are gone: a least-squares fit of 172 rank timings
# (runs BU–BY, H100, 8K × 64 heads, TP 4 / 8, costs 0–550, every rank on one GPU;
# benchmarks/fit_query_cost.py) gives 0.252 µs a query against 1.170 ns a key, 215 keys (90 %:
# 197–233); the same fit through the copies gives 297, the old 290.
QUERY_COST_KEYS = 215


def enabled(setting: bool | None, backend: str, tp: int, cp: int) -> bool:
    """Whether a layer splits its sparse attention by tokens: `setting` (the provider's
    dsa_token_parallel) when given, else (None) where it is measured faster — the fused "tilelang"
    backend at TP > 1 (per rank at 8K × 64 heads, every rank on one H100, TP 2 / 4 / 8: 11.6 / 5.8 /
    3.2 ms against 15.6 / 10.5 / 6.7 split by heads; the all-to-alls, ~0.6–1.6 ms at 350 GB/s, are
    estimated, not timed; benchmarks/LOG.md) and not under context parallelism, which it does not
    support. The unfused backend's work per rank is the same either way, so it keeps heads split."""
    if tp <= 1:
        return False
    if setting is None:
        return backend == "tilelang" and cp == 1
    if setting and cp > 1:
        raise NotImplementedError("dsa_token_parallel together with context parallelism is not supported; "
                                  "leave dsa_token_parallel unset (None) or False")
    return bool(setting)


def _heads_to_tokens(x: torch.Tensor, sizes: list[int], rank: int, group) -> torch.Tensor:
    """[T, H/P, D] → [P, sizes[rank], H/P, D]: this rank's rows, block s holding rank s's heads."""
    parts, rows = group.size(), sizes[rank]
    recv = x.new_empty(parts, rows, *x.shape[1:])
    # rank d gets rows [bounds[d], bounds[d+1]) of x as they lie
    dist.all_to_all_single(recv.view(parts * rows, *x.shape[1:]), x.contiguous(), output_split_sizes=[rows] * parts,
                           input_split_sizes=sizes, group=group)
    return recv


def _tokens_to_heads(y: torch.Tensor, sizes: list[int], rank: int, group) -> torch.Tensor:
    """The inverse of _heads_to_tokens: [P, sizes[rank], H/P, D] → [T, H/P, D]."""
    parts, rows = y.shape[:2]
    recv = y.new_empty(sum(sizes), *y.shape[2:])  # block s: my heads of rank s's rows, in row order
    # block d of y (rank d's heads of my rows) goes to rank d as it lies
    dist.all_to_all_single(recv, y.contiguous().view(parts * rows, *y.shape[2:]), output_split_sizes=sizes,
                           input_split_sizes=[rows] * parts, group=group)
    return recv


class _Exchange(torch.autograd.Function):
    """_heads_to_tokens (to_tokens) or _tokens_to_heads; the backward runs the other one."""

    @staticmethod
    def forward(ctx, x, to_tokens, sizes, rank, group):
        ctx.to_tokens, ctx.sizes, ctx.rank, ctx.group = to_tokens, sizes, rank, group
        return (_heads_to_tokens if to_tokens else _tokens_to_heads)(x, sizes, rank, group)

    @staticmethod
    def backward(ctx, grad):
        back = _tokens_to_heads if ctx.to_tokens else _heads_to_tokens
        return back(grad.contiguous(), ctx.sizes, ctx.rank, ctx.group), None, None, None, None


def attend(backend, q, kv, topk, softmax_scale, v_dim, *, packed, group, lengths) -> torch.Tensor:
    """backend(q, kv, topk, …) (an attention/backends function, given head-blocked q rows) over this
    rank's tokens with all heads; q [T, H/P, D], kv [T, D], topk [T, K], lengths: the sequences'
    (summing to T) → [T, H/P, v_dim], as the backend over q would."""
    rank = group.rank()
    bounds = row_bounds(tuple(lengths), group.size(), cap=topk.shape[1], query_cost=QUERY_COST_KEYS)
    sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    q_rows = _Exchange.apply(q, True, sizes, rank, group)
    rows_topk = topk[bounds[rank]:bounds[rank + 1]]
    empty = not sizes[rank]  # fewer rows than ranks: one query without keys keeps kv in this rank's graph
    if empty:
        q_rows = torch.cat([q_rows, q_rows.new_zeros(q_rows.shape[0], 1, *q_rows.shape[2:])], dim=1)
        rows_topk = topk.new_full((1, topk.shape[1]), -1)
    out_rows = backend(q_rows, kv, rows_topk, softmax_scale, v_dim, packed=packed)
    if empty:  # sliced only then: a slice's backward zero-fills and copies the whole gradient
        out_rows = out_rows[:, :0]
    return _Exchange.apply(out_rows, False, sizes, rank, group)
