"""Lightning-indexer scores and top-k selection over a flat token layout.

All attention code in glm5_bridge works on a *flat* layout: the tokens of every sequence in the
micro-batch laid end to end ([T, ...], T = b·s for bshd, the packed length for thd), with
`starts[t]` the flat index of token t's first token. Key s is visible from query t iff
starts[t] <= s <= t. Top-k indices are flat indices, −1 where a slot is unused.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

# Rows of queries scored at once: bounds the [rows, T] fp32 score block to rows·T·4 bytes.
SCORE_ROW_CHUNK = 2048


def flat_starts_bshd(seq_len: int, batch: int, device) -> torch.Tensor:
    """starts[t] for b sequences of length s laid out [b, s] → [b·s]."""
    return (torch.arange(batch, device=device) * seq_len).repeat_interleave(seq_len)


def flat_starts_thd(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """starts[t] for packed sequences with boundaries `cu_seqlens` ([n+1], last = total)."""
    cu = cu_seqlens.to(torch.int64)
    if int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens ends at {int(cu[-1])} but the packed batch has {total} tokens")
    lengths = cu[1:] - cu[:-1]
    return cu[:-1].repeat_interleave(lengths)


def index_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """scores[t, s] = Σ_h weights[t, h] · relu(q[t, h] · k[s]) in fp32.

    q: [rows, H, D], k: [T, D], weights: [rows, H] (already scaled by H^-0.5 · D^-0.5).
    """
    logits = torch.einsum("rhd,sd->rhs", q.float(), k.float()).relu_()
    return torch.einsum("rhs,rh->rs", logits, weights.float())


def select_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, starts: torch.Tensor,
                topk: int, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Top-`topk` visible keys per query by indexer score: [T, topk] int64 flat indices, −1 padded
    (rows=(a, b): only queries a … b−1 of the T, → [b − a, topk]).

    Never raises on short sequences: a query with fewer than `topk` visible keys gets all of them
    and −1 in the remaining slots, so the width is always `topk`.
    """
    total = k.shape[0]
    a, b = rows or (0, total)
    out = torch.full((b - a, topk), -1, dtype=torch.int64, device=k.device)
    keys = torch.arange(total, device=k.device)
    width = min(topk, total)
    for r0 in range(a, b, SCORE_ROW_CHUNK):
        r1 = min(r0 + SCORE_ROW_CHUNK, b)
        scores = index_scores(q[r0:r1], k, weights[r0:r1])
        visible = (keys[None, :] >= starts[r0:r1, None]) & (keys[None, :] <= keys[r0:r1, None])
        scores = scores.masked_fill(~visible, float("-inf"))
        best, idx = scores.topk(width, dim=-1)
        out[r0 - a:r1 - a, :width] = idx.masked_fill(best == float("-inf"), -1)
    return out


def rank_chunks(rank: int, parts: int) -> tuple[int, int]:
    """The two of 2·parts row chunks TP rank `rank` takes: an early and a late one, so under the
    causal mask every rank gets about the same number of (query, key) pairs."""
    return rank, 2 * parts - 1 - rank


def row_order(total: int, parts: int, device=None) -> tuple[torch.Tensor, int]:
    """How tensor-parallel ranks share T query rows: (order, chunk). The rows are padded to 2·parts
    chunks of `chunk` rows, each rank taking its `rank_chunks`; `order` lists the padded rows rank
    by rank (rank r's are order[2·chunk·r : 2·chunk·(r+1)]; values ≥ T are padding)."""
    chunk = -(-total // (2 * parts))
    starts = [c for r in range(parts) for c in rank_chunks(r, parts)]
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in starts]), chunk


class RowSplit(NamedTuple):
    """`row_order` as the index tensors the TP row split moves data with, one pass each way."""
    chunk: int
    gather: torch.Tensor  # [2·parts·chunk]: order with padding clamped to T − 1 (index_select's index)
    inverse: torch.Tensor  # [T]: the position of row t in order
    pads: tuple[tuple[int, int], ...]  # [start, stop) position ranges of order that are padding


@functools.lru_cache(maxsize=32)  # every DSA layer of a micro-batch asks for the same T
def row_split(total: int, parts: int, device) -> RowSplit:
    """row_order(total, parts) as a RowSplit on `device` (cached: callers must not modify it)."""
    order, chunk = row_order(total, parts, device)
    inverse = torch.empty(total, dtype=torch.int64, device=device)
    valid = order < total
    inverse[order[valid]] = torch.arange(order.numel(), device=device)[valid]
    starts = [c for r in range(parts) for c in rank_chunks(r, parts)]
    pads = tuple((i * chunk + max(0, min(chunk, total - c * chunk)), (i + 1) * chunk)
                 for i, c in enumerate(starts) if (c + 1) * chunk > total)
    return RowSplit(chunk, order.clamp(max=total - 1), inverse, pads)


def select_topk_split(select, q, k, weights, starts, topk: int, group) -> torch.Tensor:
    """`select` (a select_topk) with the query rows split across the ranks of `group` (tensor
    parallel), then all-gathered: every rank holds the same q, k and weights (megatron-core
    replicates the DSA indexer) and returns the same [T, topk], but scores only its rows of
    `row_order` (1/P of them, balanced under the causal mask)."""
    parts = group.size() if group is not None and torch.distributed.is_initialized() else 1
    if parts == 1:
        return select(q, k, weights, starts, topk)
    rank, total = group.rank(), k.shape[0]
    split = row_split(total, parts, k.device)
    chunk = split.chunk
    # int32 on the wire (indices < 2^31): half the bytes of the int64 callers get
    mine = torch.full((2 * chunk, topk), -1, dtype=torch.int32, device=k.device)
    for i, c in enumerate(rank_chunks(rank, parts)):
        a, b = min(c * chunk, total), min((c + 1) * chunk, total)
        if b > a:
            mine[i * chunk:i * chunk + b - a] = select(q, k, weights, starts, topk, rows=(a, b))
    gathered = torch.empty((parts * 2 * chunk, topk), dtype=torch.int32, device=k.device)
    torch.distributed.all_gather_into_tensor(gathered, mine, group=group)
    return gathered.index_select(0, split.inverse).long()


def check_topk(topk: torch.Tensor, starts: torch.Tensor) -> None:
    """Raise if any index lies outside its query's causal window (used for given, not computed, top-k)."""
    rows = torch.arange(topk.shape[0], device=topk.device)[:, None]
    bad = (topk >= 0) & ((topk < starts[:, None]) | (topk > rows))
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        raise ValueError(f"top-k row {t} selects key {int(topk[t][bad[t]][0])} outside its causal "
                         f"window [{int(starts[t])}, {t}]")
