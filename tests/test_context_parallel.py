"""Context parallel DSA (model/attention/context_parallel.py) on CPU, gloo ranks, tiny GLM-5.2:
every packed sequence split over the CP ranks (chunks r and 2·CP − 1 − r), the latent kv rows and
indexer keys gathered per layer. Reference: the same model at CP 1 (itself within 1e-5 of
transformers, test_parity.py). Sequences of uneven lengths, longer than top-k 8 (selection active),
IndexShare "shared" layers reusing a gathered top-k. Logits within 1e-5; the gradient of the summed
next-token log-probs (each CP rank's share summed over the ranks) within 1e-5 of each tensor's
largest entry. R3 replay under CP: a random (valid, causal) top-k payload per sequence, replayed at
CP 2 × TP 2 and at CP 1, logits within 1e-5 (and far from the indexer's own choice). Training at CP 2:
test_engine.py's cp2 layouts (SFT; RL with the top-k and routed experts replayed)."""

import pytest
import torch

from glm5_bridge.distributed import run_local_ranks
from glm5_bridge.model.attention.context_parallel import local_rows

LENGTHS = [24, 16, 12]  # multiples of 2 × CP × TP = 8 … 4: each splits into equal chunks


def _random_payloads(topk: int, layers: int) -> list:
    """One random top-k request per sequence: row i picks min(i + 1, topk) distinct keys of [0, i]."""
    from glm5_bridge.model.payload import RequestTopk

    g = torch.Generator().manual_seed(11)
    out = []
    for n in LENGTHS:
        t = torch.full((n, layers, topk), -1, dtype=torch.int32)
        for i in range(n):
            for j in range(layers):
                keys = torch.randperm(i + 1, generator=g)[:topk]
                t[i, j, :keys.numel()] = keys.to(torch.int32)
        out.append(RequestTopk(t))
    return out


def _logits_and_grads(rank, world_size, path, cp, tp):
    import glm5_bridge
    glm5_bridge.register()
    glm5_bridge.enable_cpu_support()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from glm5_bridge.testing import load_megatron
    from glm5_bridge.train.data import packed_seq_params

    _, model = load_megatron(path, context_parallel_size=cp, cp_comm_type="allgather", tensor_model_parallel_size=tp,
                             sequence_parallel=tp > 1, mtp_loss_scaling_factor=0.0)
    g = torch.Generator().manual_seed(3)
    ids = torch.cat([torch.randint(0, 256, (n,), generator=g) for n in LENGTHS])
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    rows = local_rows(tuple(LENGTHS), cp, parallel_state.get_context_parallel_rank())

    def forward(psp):
        out = model(input_ids=ids[rows][None], position_ids=positions[rows][None], attention_mask=None,
                    packed_seq_params=psp)
        return (gather_from_tensor_model_parallel_region(out) if tp > 1 else out)[0]

    with torch.no_grad():  # R3 replay of a random payload (its own packed_seq_params carries it)
        from glm5_bridge.model.replay import IndexerReplay

        psp = packed_seq_params(LENGTHS)
        IndexerReplay.attach(psp, _random_payloads(model.config.dsa_indexer_topk,
                                                   model.config.dsa_indexer_types.count("full")))
        replayed = forward(psp)
    logits = forward(packed_seq_params(LENGTHS))
    nxt = torch.roll(ids, -1)[rows]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, nxt[:, None])[:, 0]
    logp.sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad, group=parallel_state.get_context_parallel_group())  # the CP ranks' shares
        if tp > 1 and getattr(p, "sequence_parallel", False):  # as megatron's finalize_model_grads: each TP rank's tokens
            torch.distributed.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        if tp == 1 or not getattr(p, "tensor_model_parallel", False):
            grads[name] = grad
    parallel_state.destroy_model_parallel()
    return rows, logits.detach(), grads, replayed


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    path = str(tiny_checkpoint("GLM-5.2"))
    return path, run_local_ranks(_logits_and_grads, 1, path, 1, 1)[0]


# CP 2 alone is the training test's (test_engine.py cp2: per-step loss and final LoRA weights); here
# CP 2 × TP 2, which has every piece of it and sequence parallel on top.
@pytest.mark.parametrize("cp,tp", [(2, 2)], ids=["cp2_tp2"])
def test_cp_matches_cp1(reference, cp, tp):
    path, (_, ref_logits, ref_grads, ref_replayed) = reference
    assert (ref_replayed - ref_logits).abs().max().item() > 1e-2  # the payload is not the indexer's choice
    for rows, logits, grads, replayed in run_local_ranks(_logits_and_grads, cp * tp, path, cp, tp):
        assert (logits - ref_logits[rows]).abs().max().item() <= 1e-5
        assert (replayed - ref_replayed[rows]).abs().max().item() <= 1e-5  # R3 replay: each rank its rows
        assert len(grads) > (40 if tp == 1 else 10)
        # fp32 sums in another order: each tensor within 1e-5 of its largest entry (which reach ~20)
        assert max(((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1)).item()
                   for n in grads) <= 1e-5


def test_a_pack_that_cannot_split_is_refused_in_one_line():
    with pytest.raises(ValueError) as err:
        local_rows((24, 10), 2, 0)
    assert str(err.value) == ("context parallel size 2: a packed sequence of 10 tokens cannot be split into 4 equal "
                              "chunks (every length must be a multiple of 2 × CP = 4)")
    assert local_rows((8,), 2, 1).tolist() == [2, 3, 4, 5]  # chunks 1 and 2 of 4
