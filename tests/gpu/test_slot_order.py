"""kernel_indices' reordering on the GPU (glm5_bridge/kernels/slot_order.py): our TileLang kernel
against the torch version beside it, element for element, and its time against torch's at GLM-5's
8K tokens × 2048 slots (printed, not asserted).

Rows: random indices with negatives of every size (any negative is an empty slot), all empty, all
used, top-k widths padded to the kernels' multiple of 64 (100 → 128, 8 → 64) or not (2048).
"""

import statistics
import sys
from pathlib import Path

import pytest
import torch

from glm5_bridge.kernels import slot_order
from glm5_bridge.kernels.ops import kernel_topk

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("t,k,dtype", [(37, 2048, torch.int64), (300, 100, torch.int32), (5, 8, torch.int64),
                                       (1, 64, torch.int32), (9, 320, torch.int64)])
def test_used_first_kernel_matches_torch(t, k, dtype):
    g = torch.Generator(device="cuda").manual_seed(t + k)
    topk = torch.randint(0, 50_000, (t, k), device="cuda", generator=g, dtype=torch.int64)
    empty = torch.rand(t, k, device="cuda", generator=g) < torch.rand(t, 1, device="cuda", generator=g)
    topk = torch.where(empty, -torch.randint(1, 9, (t, k), device="cuda", generator=g), topk).to(dtype)
    topk[0] = -1  # an all-empty row
    if t > 2:
        topk[2] = torch.arange(k, device="cuda")  # an all-used row
    if dtype == torch.int64 and t > 1:
        topk[1, 0] = -(2**33)  # negative, but a plain int32 cast would make it 0
    idx, used = slot_order.used_first(topk, kernel_topk(k))
    ref_idx, ref_used = slot_order.used_first_reference(topk.cpu(), kernel_topk(k))
    assert idx.dtype == used.dtype == torch.int32 and idx.shape == (t, kernel_topk(k))
    assert torch.equal(idx.cpu(), ref_idx) and torch.equal(used.cpu(), ref_used)
    print(f"RESULT slot_order t={t} k={k} rows_equal={t}")


def test_used_first_kernel_time_at_8k():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from timing import times_ms

    g = torch.Generator(device="cuda").manual_seed(8)
    s, k = 8192, 2048
    visible = torch.arange(1, s + 1, device="cuda").clamp(max=k)  # causal: token t sees min(t + 1, k) keys
    topk = torch.randint(0, s, (s, k), device="cuda", generator=g)
    topk = topk.masked_fill(torch.arange(k, device="cuda")[None] >= visible[:, None], -1)
    topk = topk[:, torch.randperm(k, device="cuda", generator=g)]  # −1 interleaved, as a replay may give
    ours = statistics.median(times_ms(lambda: slot_order.used_first(topk, k), 10))
    torch_ms = statistics.median(times_ms(lambda: slot_order.used_first_reference(topk, k), 10))
    assert torch.equal(slot_order.used_first(topk, k)[0], slot_order.used_first_reference(topk, k)[0])
    print(f"RESULT slot_order_time tokens={s} k={k} ours_ms={ours:.3f} torch_ms={torch_ms:.3f}")
