"""DSA sparse attention split by query tokens instead of heads under tensor parallelism (opt-in:
`dsa_token_parallel=True` on the provider).

Megatron splits attention heads across the TP ranks. In absorbed MLA with DSA a token's heads share
one gathered 576-wide key row per selected key and one fp32 dKV row, so with heads split every rank
pays those per-key costs in full for 1/TP of the heads (docs/kernels.md, run AU: at 8K a TP 8 rank's
sparse path took 8.6 ms where dense attention at its 8 heads took 2.3). Here each rank instead
attends all heads of 1/TP of the query tokens:

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

from glm5_bridge.attention.topk import row_order


def _heads_to_tokens(x: torch.Tensor, order: torch.Tensor, group) -> torch.Tensor:
    """[T, H/P, D] → [2·chunk, H, D]: this rank's rows, every rank's heads (in rank order)."""
    parts, rows_pad = group.size(), order.numel()
    padded = x.new_zeros(rows_pad, *x.shape[1:])
    padded[:x.shape[0]] = x
    send = padded[order]  # rank-major rows (padding rows are zeros)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)  # block s: rank s's heads of my rows
    mine = recv.view(parts, rows_pad // parts, *x.shape[1:])
    return mine.transpose(0, 1).reshape(rows_pad // parts, parts * x.shape[1], x.shape[2])


def _tokens_to_heads(y: torch.Tensor, order: torch.Tensor, total: int, group) -> torch.Tensor:
    """The inverse of _heads_to_tokens: [2·chunk, H, D] → [total, H/P, D]."""
    parts, rows_pad = group.size(), order.numel()
    local = y.shape[1] // parts
    send = y.view(y.shape[0], parts, local, y.shape[2]).transpose(0, 1).contiguous()  # block d: rank d's heads
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # block s: my heads of rank s's rows
    out = y.new_zeros(rows_pad, local, y.shape[2])
    out[order] = recv.view(rows_pad, local, y.shape[2])
    return out[:total]


class _HeadsToTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order, group):
        ctx.order, ctx.group, ctx.total = order, group, x.shape[0]
        return _heads_to_tokens(x, order, group)

    @staticmethod
    def backward(ctx, grad):
        return _tokens_to_heads(grad.contiguous(), ctx.order, ctx.total, ctx.group), None, None


class _TokensToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, order, total, group):
        ctx.order, ctx.group = order, group
        return _tokens_to_heads(y, order, total, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_tokens(grad.contiguous(), ctx.order, ctx.group), None, None, None


def attend(backend, q, kv, topk, softmax_scale, v_dim, *, packed, group) -> torch.Tensor:
    """backend(q, kv, topk, …) (an attention/backends function) over this rank's tokens with all
    heads; q [T, H/P, D], kv [T, D], topk [T, K] → [T, H/P, v_dim], as the backend over q would."""
    total = q.shape[0]
    order, chunk = row_order(total, group.size(), q.device)
    mine = order[group.rank() * 2 * chunk:(group.rank() + 1) * 2 * chunk]
    rows_topk = torch.where((mine < total)[:, None], topk[mine.clamp(max=total - 1)], -1)  # padding: no keys
    q_rows = _HeadsToTokens.apply(q, order, group)
    out_rows = backend(q_rows, kv, rows_topk, softmax_scale, v_dim, packed=packed)
    return _TokensToHeads.apply(out_rows, order, total, group)
