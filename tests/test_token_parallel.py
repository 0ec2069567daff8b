"""DSA attention split by tokens instead of heads under TP (attention/token_parallel.py): on 2 and 3
gloo ranks, each holding its heads of q, the full kv and top-k, the output (each rank's heads), dq
and dkv (summed over ranks, as megatron's TP reduction of kv's gradient does) equal the unfused
attention run whole in one process."""

import pytest
import torch

from glm5_bridge.model.attention.topk import flat_starts, select_topk
from glm5_bridge.model.attention.unfused import sparse_mla
from glm5_bridge.distributed import run_local_ranks


def _lengths(total):  # three packed sequences (fewer when total is tiny)
    cu = sorted({0, min(7, total), total // 2, total})
    return tuple(b - a for a, b in zip(cu, cu[1:]))


def _inputs(total, heads):
    g = torch.Generator().manual_seed(total + heads)
    q = torch.randn(total, heads, 24, generator=g, dtype=torch.float64)
    kv = torch.randn(total, 24, generator=g, dtype=torch.float64)
    topk = select_topk(torch.randn(total, 2, 8, generator=g), torch.randn(total, 8, generator=g),
                       torch.randn(total, 2, generator=g), flat_starts(_lengths(total), "cpu"), 6)
    dout = torch.randn(total, heads, 16, generator=g, dtype=torch.float64)
    return q, kv, topk, dout


def _backend(q, kv, topk, scale, v_dim, *, packed):
    assert q.ndim == 4  # the rows as the all-to-all delivers them: [ranks, rows, heads per rank, D]
    return sparse_mla(q, kv, topk, scale, v_dim)


def _rank(rank, world, cases):
    """This rank's (out, dq, dkv) for each (total, heads) of `cases`, in one process launch."""
    from glm5_bridge.model.attention.token_parallel import attend

    results = []
    for total, heads in cases:
        q, kv, topk, dout = _inputs(total, heads)
        local = heads // world
        mine = slice(rank * local, (rank + 1) * local)
        q_mine, kv_mine = q[:, mine].clone().requires_grad_(), kv.clone().requires_grad_()
        out = attend(_backend, q_mine, kv_mine, topk, 0.3, 16, packed=True, group=torch.distributed.group.WORLD,
                     lengths=_lengths(total))
        out.backward(dout[:, mine])
        dkv = kv_mine.grad.clone()
        torch.distributed.all_reduce(dkv)  # the TP reduction of kv's gradient
        results.append((out.detach(), q_mine.grad, dkv))
    return results


def test_token_split_attention_equals_the_whole_attention():
    # (world, [(total, heads), …]); world 3 with 2 rows: a rank without rows
    for world, cases in [(2, [(45, 4), (3, 2)]), (3, [(40, 6), (2, 3)])]:
        per_rank = run_local_ranks(_rank, world, cases)
        for i, (total, heads) in enumerate(cases):
            q, kv, topk, dout = _inputs(total, heads)
            q, kv = q.requires_grad_(), kv.requires_grad_()
            out = sparse_mla(q, kv, topk, 0.3, 16)
            out.backward(dout)
            local = heads // world
            for rank, results in enumerate(per_rank):
                o, dq, dkv = results[i]
                mine = slice(rank * local, (rank + 1) * local)
                assert torch.allclose(o, out.detach()[:, mine], atol=1e-12), (world, total, rank)
                assert torch.allclose(dq, q.grad[:, mine], atol=1e-12), (world, total, rank)
                assert torch.allclose(dkv, kv.grad, atol=1e-12), (world, total, rank)


def test_token_parallel_default_and_refusal():
    """dsa_token_parallel unset (None) splits by tokens exactly where it was measured faster: the
    fused backend at TP > 1 without context parallelism; True / False are kept, and True under
    CP is refused in one line."""
    from glm5_bridge.model.attention.token_parallel import enabled

    assert [enabled(None, "tilelang", tp, 1) for tp in (1, 2, 8)] == [False, True, True]
    assert not enabled(None, "megatron", 2, 1) and not enabled(None, "tilelang", 2, 2)
    assert enabled(True, "megatron", 2, 1) and not enabled(False, "tilelang", 8, 1) and not enabled(True, "tilelang", 1, 4)
    with pytest.raises(NotImplementedError, match="context parallelism"):
        enabled(True, "tilelang", 2, 2)
