"""Our sparse-MLA backward kernels (glm5_bridge/kernels/sparse_mla_bwd.py) and the float16 forward,
against their fp32 torch references (`bwd_reference`, `fwd_reference`), on the GPU.

Inputs in the kernel dtype; lse and out from the fp32 reference forward (out rounded to the dtype),
so the backward is checked on its own. Error = ‖x − ref‖ / ‖ref‖: dq, dkv ≤ 1e-2 in bfloat16,
≤ 2e-3 in float16 (3 more mantissa bits). Shapes: packed short sequences (−1 slots interleaved,
rows with fewer visible keys than top-k, totals not a multiple of 64), one all-empty row (no
gradient); 8, 16 and 32 heads (token groups of 8, 4, 2), 64 and 128 heads (128 = two head
blocks adding into one dkv); the slots as drawn and reordered used-first (what SparseMLA passes).
"""

import pytest
import torch

from glm5_bridge.kernels import sparse_mla_bwd as B
from glm5_bridge.kernels import sparse_mla_fwd as F
from glm5_bridge.kernels.reference import random_causal_topk
from glm5_bridge.kernels.ops import kernel_indices
from glm5_bridge.testing import rel_error as rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCALE, TOPK = 1 / 16, 2048
CASES = [([1, 63, 1000, 130], 64), ([300, 5], 128), ([1, 63, 1000, 130], 16), ([777], 16), ([1, 63, 1000, 130], 32),
         ([777], 32), ([1, 63, 1000, 130], 8), ([777], 8)]
# 777: the token groups' last group short (8 heads: 1 token of 8, 16: 1 of 4, 32: 1 of 2)
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def inputs(lengths, heads, dtype, used_first=False):
    g = torch.Generator(device="cuda").manual_seed(sum(lengths) + heads)
    total = sum(lengths)
    q = torch.randn(total, heads, 576, device="cuda", generator=g).to(dtype)
    kv = torch.randn(total, 576, device="cuda", generator=g).to(dtype)
    idx = random_causal_topk(lengths, TOPK, device="cuda", generator=g).int()
    idx[min(3, total - 1)] = -1
    if used_first:
        idx = kernel_indices(idx)[0][0, :, 0]
    dout = torch.randn(total, heads, 512, device="cuda", generator=g).to(dtype)
    return q, kv, idx, dout


@pytest.mark.parametrize("used_first", [False, True], ids=["interleaved", "used_first"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("lengths,heads", CASES)
def test_bwd_matches_reference(lengths, heads, dtype, used_first):
    q, kv, idx, dout = inputs(lengths, heads, dtype, used_first)
    out, lse = F.fwd_reference(q, kv, idx, SCALE)
    out = out.to(dtype)
    dq, dkv = B.bwd(q, kv, out, dout, idx, lse, SCALE)
    ref_dq, ref_dkv = B.bwd_reference(q, kv, out, dout, idx, lse, SCALE)
    empty = min(3, q.shape[0] - 1)
    assert torch.isfinite(dq).all() and torch.isfinite(dkv).all()
    assert (dq[empty] == 0).all()
    e_dq, e_dkv = rel(dq, ref_dq), rel(dkv, ref_dkv)
    print(f"RESULT bwd_{str(dtype)[6:]} used_first={used_first} lengths={lengths} heads={heads} dq={e_dq:.3e} dkv={e_dkv:.3e}")
    assert e_dq <= TOL[dtype] and e_dkv <= TOL[dtype]


@pytest.mark.parametrize("lengths,heads", [([1, 63, 1000, 130], 64), ([777], 16)])
def test_fwd_float16(lengths, heads):
    q, kv, idx, _ = inputs(lengths, heads, torch.float16)
    out, lse = F.fwd(q, kv, idx, SCALE)
    ref_out, ref_lse = F.fwd_reference(q, kv, idx, SCALE)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    e_out, e_lse = rel(out, ref_out), rel(lse, ref_lse)
    print(f"RESULT fwd_float16 lengths={lengths} heads={heads} out={e_out:.3e} lse={e_lse:.3e}")
    assert e_out <= TOL[torch.float16] and e_lse <= 1e-4


def test_bwd_one_build_for_all_lengths():
    kernels = (B.get_fused_kernel, B.get_delta_kernel)
    before = sum(k.cache_info().misses for k in kernels)
    for total in (1, 129, 1000, 3001):
        q, kv, idx, dout = inputs([total], 64, torch.bfloat16)
        out, lse = F.fwd(q, kv, idx, SCALE)
        dq, dkv = B.bwd(q, kv, out, dout, idx, lse, SCALE)
        assert dq.shape == (total, 64, 576) and dkv.shape == (total, 576)
    assert sum(k.cache_info().misses for k in kernels) - before <= len(kernels)


@pytest.mark.parametrize("used_first", [False, True], ids=["interleaved", "used_first"])
def test_dkv_adds_kernel_adds_once_per_selection(used_first):
    """The benchmark's add floor (dkv_adds_kernel) makes exactly the fused kernel's adds: one per
    selected (token, slot), all 576 channels, so dkv[j] = how often key j was selected."""
    _, kv, idx, _ = inputs([1, 63, 1000, 130], 16, torch.bfloat16, used_first)
    dkv = torch.zeros(kv.shape[0], 576, device="cuda")
    B.dkv_adds_kernel(TOPK)(idx, F.active_slots(idx), dkv)
    counts = torch.bincount(idx[idx >= 0].long(), minlength=kv.shape[0]).float()
    assert counts.sum() > 0
    torch.testing.assert_close(dkv, counts[:, None].expand(-1, 576), rtol=0, atol=0)


@pytest.mark.parametrize("group", [2, 4, 8])
def test_union_kernel_matches_torch(group):
    """The token groups' union (kernels/slot_union.py), the CUDA kernel at top-k 2048 against the
    torch sort the backward runs: equal, on packed causal rows with −1 slots interleaved, groups that
    select nothing and a short last group (3197 tokens), and on rows whose keys span 50 000 (7 windows
    of the kernel's key map)."""
    from glm5_bridge.kernels.slot_union import WINDOW, union_slots_kernel, union_slots_reference

    _, _, idx, _ = inputs([1, 63, 3000, 130, 3], 16, torch.bfloat16)
    idx[8:16] = -1  # whole groups that select nothing
    g = torch.Generator(device="cuda").manual_seed(group)
    wide = torch.stack([torch.randperm(50_000, device="cuda", generator=g)[:TOPK] for _ in range(8 * group)]).int()
    wide[1, ::3] = -1
    wants = []
    for rows in (idx, wide):
        got, want = union_slots_kernel(rows, group), union_slots_reference(rows, group)
        for name, a, b in zip(("union", "vis", "cnt"), got, want):
            assert torch.equal(a, b), name
        wants.append(want)
    (_, _, causal_cnt), (wide_union, _, wide_cnt) = wants
    assert causal_cnt.min() == 0 and causal_cnt.max() > TOPK  # an empty group and one that shares little
    assert wide_cnt.max() > TOPK and (wide_union.max() - wide_union[wide_union >= 0].min()) > 6 * WINDOW
