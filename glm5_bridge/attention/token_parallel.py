"""DSA sparse attention split by query tokens instead of heads under tensor parallelism (opt-in:
`dsa_token_parallel=True` on the provider).

Megatron splits attention heads across the TP ranks. In absorbed MLA with DSA a token's heads share
one gathered 576-wide key row per selected key and one fp32 dKV row, so with heads split every rank
pays those per-key costs in full for 1/TP of the heads (docs/kernels.md, run AU: at 8K a TP 8 rank's
sparse path took 8.6 ms where dense attention at its 8 heads took 2.3). Here each rank instead
attends all heads of 1/TP of the query tokens (runs AV–AY, every rank emulated on one H100: a TP 8
rank's attention fwd + bwd 3.7 / 7.2 ms at 8K / 16K against 6.7 / 20.3 with heads split, before the
all-to-alls' wire time):

    q [T, H/P, 576] (heads split) --all-to-all--> [rows, H, 576] (tokens split)
    backend(q rows, the full kv, their top-k rows) -> out [rows, H, 512]
    out --all-to-all--> [T, H/P, 512] (heads split again, for W_UV and o_proj)

Every rank already holds the full kv [T, 576] and the same top-k [T, K] (computed by the duplicated
kv_a path and the indexer). A rank's rows are its share of attention/topk.row_order (2 of 2P
chunks, balanced under the causal mask, as the indexer's split uses). Gradients: the all-to-alls'
backward is the reverse all-to-all; each rank's dkv is a partial sum (its rows, all heads) where
with heads split it was another one (all rows, its heads); either way the ranks' partials add up
to dkv, which megatron's existing TP reduction of kv's gradient does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from glm5_bridge.attention.topk import RowSplit, row_split


def _transpose01(x: torch.Tensor) -> torch.Tensor:
    """x [A, B, ...] → contiguous [B, A, ...]. The copy is strided, so torch runs it element by
    element: bf16 rows go as 8-byte words where their width allows (half the time of 2-byte
    elements at TP 8 × 8K, docs/kernels.md run AY)."""
    if x.shape[-1] * x.element_size() % 8 == 0 and x.stride(-1) == 1 and x.element_size() < 8:
        return x.view(torch.int64).transpose(0, 1).contiguous().view(x.dtype)
    return x.transpose(0, 1).contiguous()


def _heads_to_tokens(x: torch.Tensor, split: RowSplit, group) -> torch.Tensor:
    """[T, H/P, D] → [2·chunk, H, D]: this rank's rows, every rank's heads (in rank order)."""
    parts, rows = group.size(), 2 * split.chunk
    send = x.index_select(0, split.gather)  # rank-major rows, one pass
    for start, stop in split.pads:  # padding rows (a copy of row T − 1 so far) go out as zeros
        send[start:stop] = 0
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # block s: rank s's heads of my rows
    return _transpose01(recv.view(parts, rows, *x.shape[1:])).view(rows, parts * x.shape[1], x.shape[2])


def _tokens_to_heads(y: torch.Tensor, split: RowSplit, group) -> torch.Tensor:
    """The inverse of _heads_to_tokens: [2·chunk, H, D] → [T, H/P, D]."""
    parts = group.size()
    local = y.shape[1] // parts
    send = _transpose01(y.view(y.shape[0], parts, local, y.shape[2]))  # block d: rank d's heads
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # block s: my heads of rank s's rows
    return recv.view(-1, local, y.shape[2]).index_select(0, split.inverse)  # padding rows dropped


class _HeadsToTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split, group):
        ctx.split, ctx.group = split, group
        return _heads_to_tokens(x, split, group)

    @staticmethod
    def backward(ctx, grad):
        return _tokens_to_heads(grad.contiguous(), ctx.split, ctx.group), None, None


class _TokensToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, split, group):
        ctx.split, ctx.group = split, group
        return _tokens_to_heads(y, split, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_tokens(grad.contiguous(), ctx.split, ctx.group), None, None


def attend(backend, q, kv, topk, softmax_scale, v_dim, *, packed, group) -> torch.Tensor:
    """backend(q, kv, topk, …) (an attention/backends function) over this rank's tokens with all
    heads; q [T, H/P, D], kv [T, D], topk [T, K] → [T, H/P, v_dim], as the backend over q would."""
    split = row_split(q.shape[0], group.size(), q.device)
    lo, hi = group.rank() * 2 * split.chunk, (group.rank() + 1) * 2 * split.chunk
    rows_topk = topk.index_select(0, split.gather[lo:hi])
    for start, stop in split.pads:
        if lo <= start < hi:
            rows_topk[start - lo:stop - lo] = -1  # padding rows select no keys
    q_rows = _HeadsToTokens.apply(q, split, group)
    out_rows = backend(q_rows, kv, rows_topk, softmax_scale, v_dim, packed=packed)
    return _TokensToHeads.apply(out_rows, split, group)
