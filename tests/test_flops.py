"""train/flops.py against torch's FlopCounterMode on transformers' GlmMoeDsa forward (tiny GLM-5.2).

The counter sees every linear layer (MLA and indexer projections, router, shared expert, dense MLP,
LM head) but not transformers' fused routed-expert kernel, so the routed experts' term is added from
the config; attention is dense in transformers (every key, then masked), so the sparse terms are
checked against hand counts of the causal / top-k pairs instead."""

import torch
from torch.utils.flop_counter import FlopCounterMode

from glm5_bridge.tiny import make_tiny_model
from glm5_bridge.train.flops import peak_flops, projection_params_per_token, step_flops


def test_projection_flops_match_torch_flop_counter():
    model, _ = make_tiny_model("GLM-5.2")
    c, tokens = model.config, 50
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=torch.randint(0, c.vocab_size, (1, tokens)))
    counts = counter.get_flop_counts()["Global"]
    linear = sum(v for k, v in counts.items() if str(k) in ("aten.mm", "aten.addmm"))
    moe_layers = c.num_hidden_layers - c.first_k_dense_replace
    routed = 2 * c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size * tokens * moe_layers
    assert linear + routed == 2 * projection_params_per_token(c, mtp=False) * tokens


def test_sparse_terms_count_causal_and_topk_pairs():
    model, _ = make_tiny_model("GLM-5.2")
    c = model.config  # index_topk 8
    f = step_flops(c, [5, 20], mtp=False)
    pairs = 15 + 210  # causal (query, key) pairs of 5 and 20 tokens
    selected = 15 + (36 + 12 * 8)  # min(8, p + 1) summed over each sequence's positions
    computing = sum(t == "full" for t in c.indexer_types)
    assert f["indexer_scores"] == 2 * c.index_n_heads * c.index_head_dim * pairs * computing
    qk_v = c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim
    assert f["sparse_attention"] == 2 * c.num_attention_heads * qk_v * selected * c.num_hidden_layers
    assert f["lora_step"] == 2 * f["projections"] + f["indexer_scores"] + 3 * f["sparse_attention"]
    assert peak_flops("NVIDIA H100 80GB HBM3") == peak_flops("NVIDIA H200") == 989.4e12
