"""Lightning-indexer scores and top-k selection over a flat token layout.

All attention code in glm5_bridge works on a *flat* layout: the tokens of every sequence in the
micro-batch laid end to end ([T, ...], T = b·s for bshd, the packed length for thd), with
`starts[t]` the flat index of token t's first token. Key s is visible from query t iff
starts[t] <= s <= t. Top-k indices are flat indices, −1 where a slot is unused.
"""

from __future__ import annotations

import functools
import itertools

import torch

from glm5_bridge.kernels.reference import index_scores

__all__ = ["index_scores", "select_topk", "select_topk_split", "check_topk", "row_bounds", "rank_chunks",
           "sequence_lengths", "flat_starts", "flat_starts_bshd", "flat_starts_thd"]

# Rows of queries scored at once: bounds the [rows, T] fp32 score block to rows·T·4 bytes.
SCORE_ROW_CHUNK = 2048


def sequence_lengths(cu_seqlens: torch.Tensor, total: int) -> tuple[int, ...]:
    """The packed sequences' lengths from `cu_seqlens` ([n+1], last = total): one host read."""
    cu = cu_seqlens.tolist()
    if cu[-1] != total:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but the packed batch has {total} tokens")
    return tuple(b - a for a, b in zip(cu, cu[1:]))


def flat_starts(lengths: tuple[int, ...], device) -> torch.Tensor:
    """starts[t] for sequences of these lengths laid end to end → [Σ lengths] (no host sync)."""
    firsts = [0, *itertools.accumulate(lengths[:-1])]
    return torch.tensor(firsts, device=device).repeat_interleave(
        torch.tensor(lengths, device=device), output_size=sum(lengths))


def flat_starts_bshd(seq_len: int, batch: int, device) -> torch.Tensor:
    """starts[t] for b sequences of length s laid out [b, s] → [b·s]."""
    return flat_starts((seq_len,) * batch, device)


def flat_starts_thd(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """starts[t] for packed sequences with boundaries `cu_seqlens` ([n+1], last = total)."""
    return flat_starts(sequence_lengths(cu_seqlens, total), cu_seqlens.device)


def query_base(q_rows: int, a: int, b: int) -> int:
    """The row of the T-row layout that q's row 0 is, for queries a … b−1: q holds either all T rows
    (0) or exactly those b − a (a; context parallel passes a rank's own rows, without a T-row buffer).
    The two agree when b − a = T (then a = 0)."""
    return a if q_rows == b - a else 0


def select_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, starts: torch.Tensor,
                topk: int, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Top-`topk` visible keys per query by indexer score: [T, topk] int64 flat indices, −1 padded
    (rows=(a, b): only queries a … b−1 of the T, → [b − a, topk]; q and weights then hold either all
    T rows or just those b − a, see query_base).

    Never raises on short sequences: a query with fewer than `topk` visible keys gets all of them
    and −1 in the remaining slots, so the width is always `topk`.
    """
    total = k.shape[0]
    a, b = rows or (0, total)
    base = query_base(q.shape[0], a, b)
    out = torch.full((b - a, topk), -1, dtype=torch.int64, device=k.device)
    keys = torch.arange(total, device=k.device)
    width = min(topk, total)
    for r0 in range(a, b, SCORE_ROW_CHUNK):
        r1 = min(r0 + SCORE_ROW_CHUNK, b)
        scores = index_scores(q[r0 - base:r1 - base], k, weights[r0 - base:r1 - base])
        visible = (keys[None, :] >= starts[r0:r1, None]) & (keys[None, :] <= keys[r0:r1, None])
        scores = scores.masked_fill(~visible, float("-inf"))
        best, idx = scores.topk(width, dim=-1)
        out[r0 - a:r1 - a, :width] = idx.masked_fill(best == float("-inf"), -1)
    return out


@functools.lru_cache(maxsize=64)  # every DSA layer of a micro-batch asks for the same split
def row_bounds(lengths: tuple[int, ...], parts: int, cap: int | None = None, query_cost: int = 0) -> tuple[int, ...]:
    """How P tensor-parallel ranks share the T query rows of sequences of `lengths` laid end to end
    in token-parallel attention: P contiguous ranges, rank r taking rows [bounds[r], bounds[r + 1]),
    of about equal cost — a query at position p of its sequence costs min(p + 1, cap) (sparse
    attention over at most cap selected keys; cap None: p + 1) plus `query_cost`, its fixed cost
    in keys' worth (token_parallel.QUERY_COST_KEYS). Boundary i is the first row count whose rows
    cost at least i/P of the total, so a range is off by at most one query's cost (ranges may be
    empty when T < P)."""
    total = sum(lengths)
    if total == 0:
        return (0,) * (parts + 1)
    position = torch.arange(total) - flat_starts(lengths, "cpu")
    cost = (position + 1 if cap is None else (position + 1).clamp(max=cap)) + query_cost
    cum = torch.cumsum(cost, 0).double()
    targets = torch.arange(1, parts, dtype=torch.float64) * (cum[-1] / parts)
    inner = torch.searchsorted(cum, targets) + 1  # rows [0, first t with cum[t] ≥ target]
    return (0, *inner.clamp(max=total).tolist(), total)


def rank_chunks(rank: int, parts: int) -> tuple[int, int]:
    """The two of 2·parts equal row chunks TP rank `rank` scores in the indexer split: an early
    and a late one, so every rank scores about the same number of (query, key) pairs of a causal
    sequence, and every rank sends the same number of rows (one all_gather_into_tensor)."""
    return rank, 2 * parts - 1 - rank


def select_topk_split(select, q, k, weights, starts, topk: int, group) -> torch.Tensor:
    """`select` (a select_topk) with the query rows split across the ranks of `group` (tensor
    parallel), then all-gathered: every rank holds the same q, k and weights (megatron-core
    replicates the DSA indexer) and returns the same [T, topk], but scores only its `rank_chunks`
    (1/P of the rows)."""
    parts = group.size() if group is not None and torch.distributed.is_initialized() else 1
    if parts == 1:
        return select(q, k, weights, starts, topk)
    total = k.shape[0]
    chunk = -(-total // (2 * parts))
    rows = [(min(c * chunk, total), min((c + 1) * chunk, total)) for c in rank_chunks(group.rank(), parts)]
    # int32 on the wire (indices < 2^31): half the bytes of the int64 callers get. Rows a chunk
    # has past the last token stay unwritten: they land past `total` and are cut off below.
    mine = torch.empty((2 * chunk, topk), dtype=torch.int32, device=k.device)
    for i, (a, b) in enumerate(rows):
        if b > a:
            mine[i * chunk:i * chunk + b - a] = select(q, k, weights, starts, topk, rows=(a, b))
    gathered = torch.empty((parts, 2, chunk, topk), dtype=torch.int32, device=k.device)
    torch.distributed.all_gather_into_tensor(gathered.view(-1, topk), mine, group=group)
    out = torch.empty((2 * parts * chunk, topk), dtype=torch.int64, device=k.device).view(2 * parts, chunk, topk)
    out[:parts] = gathered[:, 0]  # chunk r came from rank r, chunk 2P−1−r from rank r too
    out[parts:] = gathered[:, 1].flip(0)
    return out.view(-1, topk)[:total]


def check_topk(topk: torch.Tensor, starts: torch.Tensor) -> None:
    """Raise if any index lies outside its query's causal window (used for given, not computed, top-k)."""
    rows = torch.arange(topk.shape[0], device=topk.device)[:, None]
    bad = (topk >= 0) & ((topk < starts[:, None]) | (topk > rows))
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        raise ValueError(f"top-k row {t} selects key {int(topk[t][bad[t]][0])} outside its causal "
                         f"window [{int(starts[t])}, {t}]")
