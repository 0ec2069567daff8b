"""TP=2 with sequence parallel on CPU (2 gloo processes) gives TP=1's logits, with the sparse
attention split by heads (megatron's default) or by tokens (dsa_token_parallel)."""

import pytest
import torch

from glm5_bridge.distributed import run_local_ranks


def _tp_logits(rank, world_size, path, tp, seq, token_parallel=False):
    import glm5_bridge
    glm5_bridge.register()
    glm5_bridge.enable_cpu_support()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from glm5_bridge.testing import load_megatron, megatron_logits

    _, model = load_megatron(path, tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                             dsa_token_parallel=token_parallel)
    ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = megatron_logits(model.eval(), ids)
        if tp > 1:  # vocab-parallel output: gather the vocab shards
            logits = gather_from_tensor_model_parallel_region(logits)
    parallel_state.destroy_model_parallel()
    return logits


@pytest.fixture(scope="module")
def tp1(tiny_checkpoint):
    path = str(tiny_checkpoint("GLM-5.2"))
    return path, run_local_ranks(_tp_logits, 1, path, 1, 32)[0]


@pytest.mark.parametrize("token_parallel", [False, True], ids=["heads_split", "tokens_split"])
def test_tp2_matches_tp1(tp1, token_parallel):
    path, ref = tp1
    tp2 = run_local_ranks(_tp_logits, 2, path, 2, 32, token_parallel)
    for out in tp2:
        assert out.shape == ref.shape
        assert (out - ref).abs().max().item() <= 1e-5
