"""The sparse-MLA kernels' two entry points in plain torch (fp32 math; the output in q's dtype and
fp32 gradients, as our kernels return them): same arguments, same shapes, same log2 lse
convention as `tilelang_ops()`.

`SparseMLA.apply(q, kv, topk, scale, OPS)` runs the autograd glue (head / top-k padding, index
conversion, the delta pre-pass, the dkv scatter) without a GPU; the CPU tests check it against the
unfused backend. Written from the math, not from the kernels:
    s = scale · q·k,  p = exp(s − lse),  out = p·v,  delta = Σ out·dout,
    ds = p · (dout·vᵀ − delta) · scale,  dq = ds·k,  dk = dsᵀ·q,  dv = pᵀ·dout.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from glm5_bridge.kernels.ops import D_V, MIN_HEADS

LN2 = math.log(2.0)


def index_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The lightning indexer's scores: scores[t, s] = Σ_h weights[t, h] · relu(q[t, h] · k[s]) in fp32
    (the math kernels/indexer.py's score kernel computes; model/attention/topk.py selects on it).

    q: [rows, H, D], k: [T, D], weights: [rows, H] (already scaled by H^-0.5 · D^-0.5).
    """
    logits = torch.einsum("rhd,sd->rhs", q.float(), k.float()).relu_()
    return torch.einsum("rhs,rh->rs", logits, weights.float())


def _by_token(x):
    """The kernels' rows [P, T, H/P, ...] (P = 1: flat; above: head-blocked, ops.py) → fp32 [T, H, ...]."""
    return x.float().transpose(0, 1).reshape(x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])


def _blocked(x, like):
    """[T, H, ...] → the layout of `like` ([P, T, H/P, ...])."""
    p, t, local = like.shape[:3]
    return x.reshape(t, p, local, *x.shape[2:]).transpose(0, 1).contiguous()


def _unpack(q, kv, idx):
    """Kernel layout → q [T,H,D], gathered keys [T,K,D] (fp32), valid [T,K], safe flat indices."""
    flat = idx[0, :, 0].long()
    valid = flat >= 0
    safe = flat.clamp(min=0)
    return _by_token(q), kv[0, :, 0].float()[safe], valid, safe


def _probs(q, keys, valid, scale, lse2=None):
    s = torch.einsum("thd,tkd->thk", q, keys) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1) if lse2 is None else lse2 * LN2
    lse = torch.where(valid.any(-1)[:, None], lse, torch.zeros_like(lse))  # all-empty rows: lse 0
    return torch.exp(s - lse[..., None]), lse


def fwd(q, kv, idx, scale, used=None):  # `used` (the kernels' loop bound) changes nothing here
    q32, keys, valid, _ = _unpack(q, kv, idx)
    p, lse = _probs(q32, keys, valid, scale)
    out = torch.einsum("thk,tkc->thc", p, keys[..., :D_V])
    return _blocked(out.to(q.dtype), q), _blocked(lse / LN2, q)


def bwd(q, kv, out, dout, idx, lse, scale, used=None):
    q32, keys, valid, safe = _unpack(q, kv, idx)
    p, _ = _probs(q32, keys, valid, scale, lse2=_by_token(lse))
    do = _by_token(dout)
    delta = (_by_token(out) * do).sum(-1)
    ds = p * (torch.einsum("thc,tkc->thk", do, keys[..., :D_V]) - delta[..., None]) * scale
    dq = torch.einsum("thk,tkd->thd", ds, keys)
    dkeys = torch.einsum("thk,thd->tkd", ds, q32)
    dkeys[..., :D_V] += torch.einsum("thk,thc->tkc", p, do)
    dkeys = dkeys * valid[..., None]
    dkv = torch.zeros(kv.shape[1], kv.shape[-1], dtype=torch.float32, device=kv.device)
    dkv.index_add_(0, safe.reshape(-1), dkeys.reshape(-1, kv.shape[-1]))
    return _blocked(dq, q), dkv[None, :, None]


# pads as ours do; head_blocks: takes head-blocked rows in place, as ours can (ops.ours_take_head_blocks)
OPS = SimpleNamespace(fwd=fwd, bwd=bwd, float16=True, min_heads=MIN_HEADS, head_blocks=True)


def random_causal_topk(lengths: list[int], topk: int, *, device="cpu", generator=None) -> torch.Tensor:
    """A valid [T, topk] top-k for sequences of `lengths` packed end to end: each query picks
    min(topk, visible) distinct keys of its own causal window at random, in a random slot order
    (−1 slots interleaved, not only at the end) — inputs for checking kernels on any pattern."""
    total = sum(lengths)
    firsts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    starts = firsts.repeat_interleave(torch.tensor(lengths)).to(device)
    keys = torch.arange(total, device=device)
    out = torch.full((total, topk), -1, dtype=torch.int64, device=device)
    width = min(topk, total)
    for r0 in range(0, total, 2048):
        r1 = min(r0 + 2048, total)
        scores = torch.rand(r1 - r0, total, device=device, generator=generator)
        visible = (keys[None, :] >= starts[r0:r1, None]) & (keys[None, :] <= keys[r0:r1, None])
        best, idx = scores.masked_fill(~visible, -1.0).topk(width, dim=-1)
        out[r0:r1, :width] = idx.masked_fill(best < 0, -1)
    return out[:, torch.randperm(topk, device=device, generator=generator)]
