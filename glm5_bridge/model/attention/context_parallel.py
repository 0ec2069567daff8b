"""DSA under context parallelism: every sequence of a packed (thd) micro-batch split over the CP ranks.

Layout (megatron's, which its thd rope follows): a sequence of length L is cut into 2·CP equal chunks
and rank r holds chunks r and 2·CP − 1 − r, so each rank has an early and a late part of every
sequence and about the same causal work. L must be a multiple of 2·CP (the trainer pads).

A rank's queries need keys from every rank. Per layer it gathers, in the sequence's global order,
what a key is to DSA: the latent kv row (576 values) and the indexer key (128) — not full K/V. Its
queries are scored against every causal key of their sequence, their top-k are flat indices into
the gathered (global) layout, and the sparse attention runs on the gathered kv. The gather's
backward adds every rank's dkv for a row and hands the sum to the rank that owns the row (a
reduce-scatter; an all-reduce then a slice on gloo, which has no reduce-scatter), exactly.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist


@functools.lru_cache(maxsize=64)
def _rank_rows(lengths: tuple[int, ...], parts: int) -> tuple[tuple[int, ...], ...]:
    """For each CP rank, the global flat indices of its tokens, in its local order."""
    bad = [n for n in lengths if n % (2 * parts)]
    if bad:
        raise ValueError(f"context parallel size {parts}: a packed sequence of {bad[0]} tokens cannot be split "
                         f"into {2 * parts} equal chunks (every length must be a multiple of 2 × CP = {2 * parts})")
    ranks = []
    for r in range(parts):
        rows, offset = [], 0
        for n in lengths:
            c = n // (2 * parts)
            for chunk in (r, 2 * parts - 1 - r):
                rows.extend(range(offset + chunk * c, offset + (chunk + 1) * c))
            offset += n
        ranks.append(tuple(rows))
    return tuple(ranks)


@functools.lru_cache(maxsize=64)
def _rows_tensor(lengths: tuple[int, ...], parts: int, rank: int | None, device: torch.device) -> torch.Tensor:
    """Rank `rank`'s rows (None: every rank's, rank after rank) as an int64 tensor on `device`. Every
    DSA layer of a micro-batch, forward and backward, asks for the same ones: built once."""
    ranks = _rank_rows(lengths, parts)
    rows = ranks[rank] if rank is not None else [i for r in ranks for i in r]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def local_rows(lengths: tuple[int, ...], parts: int, rank: int, device=None) -> torch.Tensor:
    """Global flat indices of CP rank `rank`'s tokens (int64), for sequences of global `lengths`.
    Shared by every caller with the same arguments: read it, do not write into it."""
    return _rows_tensor(tuple(lengths), parts, rank, torch.device(device or "cpu"))


def _all_rows(lengths, parts, device) -> torch.Tensor:
    """[parts · T/parts]: every rank's rows, rank after rank (the all-gather's order)."""
    return _rows_tensor(tuple(lengths), parts, None, torch.device(device))


class _GatherSequence(torch.autograd.Function):
    """[T/CP, ...] local rows → [T, ...] in global order; backward: each row's gradient summed over
    the ranks, to its owner."""

    @staticmethod
    def forward(ctx, x, lengths, group):
        parts = group.size()
        gathered = x.new_empty(parts * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(gathered, x.contiguous(), group=group)
        order = _all_rows(lengths, parts, x.device)
        out = x.new_empty(gathered.shape)
        out[order] = gathered
        ctx.lengths, ctx.group, ctx.local = lengths, group, x.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad):
        group, parts = ctx.group, ctx.group.size()
        by_rank = grad[_all_rows(ctx.lengths, parts, grad.device)].contiguous()  # rank after rank
        if dist.get_backend(group) == "gloo":  # no reduce-scatter: sum everywhere, keep my block
            dist.all_reduce(by_rank, group=group)
            mine = by_rank.view(parts, ctx.local, *grad.shape[1:])[group.rank()]
        else:
            mine = grad.new_empty(ctx.local, *grad.shape[1:])
            dist.reduce_scatter_tensor(mine, by_rank, group=group)
        return mine, None, None


def gather_sequence(x: torch.Tensor, lengths: tuple[int, ...], group) -> torch.Tensor:
    """This rank's rows of every sequence → the whole packed micro-batch in global order (autograd)."""
    return _GatherSequence.apply(x, tuple(lengths), group)


def select_local_topk(select, q: torch.Tensor, k_global: torch.Tensor, weights: torch.Tensor,
                      starts_global: torch.Tensor, rows: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-k (global flat indices, [T/CP, topk]) of this rank's queries `q` / `weights` (its rows
    `rows` of the global layout) against every key `k_global`. Each contiguous chunk of the rank's
    rows is scored alone; `select` takes it as rows=(first, last + 1) with q holding just those rows
    (attention/topk.query_base), so no sequence-sized query buffer is built."""
    out = []
    bounds = (torch.nonzero(torch.diff(rows) != 1).flatten() + 1).tolist()
    for a, b in zip([0, *bounds], [*bounds, rows.numel()]):
        first = int(rows[a])
        out.append(select(q[a:b], k_global, weights[a:b], starts_global, topk, rows=(first, first + b - a)))
    return torch.cat(out)
