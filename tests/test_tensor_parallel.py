"""TP=2 with sequence parallel on CPU (2 gloo processes) gives TP=1's logits, with the sparse
attention split by heads (megatron's default) or by tokens (dsa_token_parallel)."""

import pytest
import torch

from glm5_bridge.distributed import run_local_ranks


def _tp_logits(rank, world_size, path, tp, seq, token_parallel_settings=(False,)):
    """Logits of the model at `tp` for each dsa_token_parallel setting, in one process launch."""
    import glm5_bridge
    glm5_bridge.register()
    glm5_bridge.enable_cpu_support()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from glm5_bridge.testing import load_megatron, megatron_logits

    ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(7))
    results = []
    for token_parallel in token_parallel_settings:
        _, model = load_megatron(path, tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                                 dsa_token_parallel=token_parallel)
        with torch.no_grad():
            logits = megatron_logits(model.eval(), ids)
            if tp > 1:  # vocab-parallel output: gather the vocab shards
                logits = gather_from_tensor_model_parallel_region(logits)
        parallel_state.destroy_model_parallel()
        results.append(logits)
    return results


@pytest.fixture(scope="module")
def tp1(tiny_checkpoint):
    path = str(tiny_checkpoint("GLM-5.2"))
    return path, run_local_ranks(_tp_logits, 1, path, 1, 32)[0][0]


def test_tp2_matches_tp1_split_by_heads_and_by_tokens(tp1):
    path, ref = tp1
    per_rank = run_local_ranks(_tp_logits, 2, path, 2, 32, (False, True))
    for rank, outs in enumerate(per_rank):
        for token_parallel, out in zip((False, True), outs):
            assert out.shape == ref.shape
            assert (out - ref).abs().max().item() <= 1e-5, (rank, token_parallel)
