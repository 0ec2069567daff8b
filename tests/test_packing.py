"""Packed micro-batches (glm5_bridge/train/data): the padding a layout adds, the MTP loss mask, and the
payload rows that follow the pads (glm5_bridge/model/payload.py). Hand-worked examples."""

import torch

from glm5_bridge.model.payload import RequestTopk
from glm5_bridge.train.data import PAD_ID, mtp_loss_mask, pack, pad_each_sequence, pad_mask, padded


def _batch():
    # two samples, 5 and 3 tokens; loss on tokens 3, 4 of the first and 2 of the second
    batch = pack([([5, 6, 7, 8, 9], [0, 0, 0, 1, 1]), ([4, 3, 2], [0, 0, 1])], vocab_size=16)
    batch.advantages = torch.tensor([[1.0, 1, 1, 1, 1, 2, 2, 2]])  # a trainer's own per-token field
    return batch


def test_pad_each_sequence_pads_every_per_token_field():
    out = pad_each_sequence(_batch(), 4)
    assert out.lengths == [8, 4] and out.sequence_pads == [3, 1]
    assert out.input_ids.tolist() == [[5, 6, 7, 8, 9, PAD_ID, PAD_ID, PAD_ID, 4, 3, 2, PAD_ID]]
    assert out.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
    assert out.loss_mask.tolist() == [[0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0]]
    assert out.advantages.tolist() == [[1, 1, 1, 1, 1, 0, 0, 0, 2, 2, 2, 0]]
    assert pad_mask(out).tolist() == [[0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1]]
    seg = padded(out, 16)  # then a padding segment: the trainer's field too
    assert seg.lengths == [8, 4, 4] and seg.advantages.shape == (1, 16) and seg.advantages[0, 12:].eq(0).all()
    assert pad_mask(seg)[0, 12:].eq(1).all() and seg.position_ids[0, 12:].tolist() == [0, 1, 2, 3]


def test_mtp_loss_mask_is_the_label_mask_seen_from_the_inputs():
    # label side: loss_mask[t] says whether token t + 1 is learned; megatron's MTP rolls the mask with
    # the inputs, so it takes token t's own flag: 0 at each sequence's first token
    assert _batch().loss_mask.tolist() == [[0, 0, 1, 1, 0, 0, 1, 0]]
    assert mtp_loss_mask(_batch()).tolist() == [[0, 0, 0, 1, 1, 0, 0, 1]]


def test_window_rows_follow_a_payload():
    req = RequestTopk(torch.tensor([[[0, -1, -1]], [[1, 0, -1]]], dtype=torch.int32))  # 2 rows, 1 layer, top-k 3
    out = req.with_window_rows(2)
    assert out.shape == (4, 1, 3)
    assert out.layer(0).tolist() == [[0, -1, -1], [1, 0, -1], [2, 1, 0], [3, 2, 1]]
    out.check()  # causal, distinct


def test_fit_all_gives_a_pipeline_step_one_shape():
    """CP 2 × PP 2: each sequence padded to a multiple of 2·CP = 4, then every micro-batch of the step
    to one length (pipeline stages exchange fixed shapes): data.max_tokens, or more where the pads
    take one past it — the packers count real tokens, so the layout never regroups samples."""
    from types import SimpleNamespace

    from glm5_bridge.train.engine import Engine
    from glm5_bridge.train.recipe import load_recipe

    engine = Engine.__new__(Engine)  # fit_all needs the recipe and the dispatcher only
    engine.recipe = load_recipe(None, ["model.context_parallel_size=2", "model.pipeline_model_parallel_size=2",
                                       "data.max_tokens=16"])
    engine.config = SimpleNamespace(moe_token_dispatcher_type="alltoall")
    short = pack([([1] * 5, [1] * 5), ([2] * 3, [1] * 3)], vocab_size=8)  # 8 tokens → 8 + 4
    long = pack([([1] * 7, [1] * 7), ([2] * 7, [1] * 7), ([3], [1])], vocab_size=8)  # 15 → 8 + 8 + 4 = 20
    fitted = engine.fit_all([short, long])
    assert [b.lengths for b in fitted] == [[8, 4, 8], [8, 8, 4]]
    assert [int(pad_mask(b).sum()) for b in fitted] == [12, 5]
    assert [b.lengths for b in engine.fit_all([short])] == [[8, 4, 4]]  # alone: data.max_tokens
