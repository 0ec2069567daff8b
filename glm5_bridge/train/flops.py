"""FLOPs of a GLM-5.x forward and of a LoRA training step, for MFU.

What is counted (2 FLOPs a multiply-add; norms, activations, softmax, rope, top-k left out):
- projections, per token: every weight matrix a token passes through — MLA's q_a, q_b, kv_a, kv_b
  (applied per token, as the HF layer computes it), o; the indexer's wq_b, wk and weights_proj on
  layers that compute top-k; the dense MLP, or the router, the top-k routed experts and the shared
  expert; the LM head; the MTP layer (eh_proj, a full decoder layer, the shared LM head) when the
  model has one, since Megatron runs it in every training forward;
- indexer scores: every causal key of every query, index_n_heads × index_head_dim;
- sparse attention: min(index_topk, causal keys) keys a query, num_heads × (qk_head_dim + v_head_dim).
A LoRA step's backward computes activation gradients only (the base is frozen; the indexer, outside
LoRA and feeding a discrete top-k, has none): projections 2× their forward, sparse attention 3×
(forward, dQ, dKV), indexer scores 1×; the adapters' own matmuls (rank ≪ width) are left out.
`six_n` gives the usual 6 × active parameters × tokens for comparison.
"""

from __future__ import annotations


def _attention_projection_params(c) -> tuple[int, int]:
    """(MLA projections, indexer projections) weights a token passes through in one layer."""
    h, heads = c.hidden_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    mla = (h * c.q_lora_rank + c.q_lora_rank * heads * qk + h * (c.kv_lora_rank + c.qk_rope_head_dim)
           + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim) + heads * c.v_head_dim * h)
    indexer = c.q_lora_rank * c.index_n_heads * c.index_head_dim + h * c.index_head_dim + h * c.index_n_heads
    return mla, indexer


def _mlp_params(c, dense: bool) -> int:
    h = c.hidden_size
    if dense:
        return 3 * h * c.intermediate_size
    return h * c.n_routed_experts + (c.num_experts_per_tok + c.n_shared_experts) * 3 * h * c.moe_intermediate_size


def computing_layers(c) -> list[bool]:
    """Per decoder layer: does it run an indexer (IndexShare's "full"), or reuse one ("shared")."""
    types = getattr(c, "indexer_types", None) or ["full"] * c.num_hidden_layers
    return [t == "full" for t in types]


def projection_params_per_token(c, mtp: bool = True) -> int:
    """Weights one token multiplies through in a forward (see the module docstring)."""
    mla, indexer = _attention_projection_params(c)
    total = 0
    for i, computes in enumerate(computing_layers(c)):
        total += mla + (indexer if computes else 0) + _mlp_params(c, dense=i < c.first_k_dense_replace)
    total += c.hidden_size * c.vocab_size
    if mtp and getattr(c, "num_nextn_predict_layers", 0):
        h = c.hidden_size
        total += 2 * h * h + mla + indexer + _mlp_params(c, dense=False) + h * c.vocab_size
    return total


def step_flops(c, lengths: list[int], mtp: bool = True) -> dict:
    """FLOPs of one forward, and of one LoRA training step, over sequences of `lengths` tokens."""
    tokens = sum(lengths)
    attn_layers = c.num_hidden_layers + (1 if mtp and getattr(c, "num_nextn_predict_layers", 0) else 0)
    index_layers = sum(computing_layers(c)) + (attn_layers - c.num_hidden_layers)
    causal = sum(n * (n + 1) // 2 for n in lengths)  # (query, key ≤ query) pairs
    # Σ over positions p of min(index_topk, p + 1): all causal keys up to top-k, then top-k a query
    selected = sum(m * (m + 1) // 2 + (n - m) * c.index_topk for n in lengths for m in [min(n, c.index_topk)])
    projections = 2 * projection_params_per_token(c, mtp) * tokens
    indexer_scores = 2 * c.index_n_heads * c.index_head_dim * causal * index_layers
    attention = (2 * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
                 * selected * attn_layers)
    return {"tokens": tokens, "projections": projections, "indexer_scores": indexer_scores,
            "sparse_attention": attention, "forward": projections + indexer_scores + attention,
            "lora_step": 2 * projections + indexer_scores + 3 * attention,
            "six_n": 6 * projection_params_per_token(c, mtp) * tokens}


PEAK_BF16_DENSE = {"H100": 989.4e12, "H200": 989.4e12, "B200": 2250e12, "A100": 312e12}  # dense, no sparsity


def peak_flops(device_name: str) -> float | None:
    """The GPU's dense bf16 tensor-core peak (FLOP/s) from its name, or None when unknown."""
    return next((v for k, v in PEAK_BF16_DENSE.items() if k in device_name.upper()), None)


def step_rate(c, micro_batches: list, seconds: float) -> dict:
    """Model FLOP rate of one training step: this rank's micro-batches' `lora_step` FLOPs (real
    sequences: a padding segment is not counted, context parallel's pads at sequence ends are),
    summed over the data-parallel ranks, over the step's seconds and every GPU of the job →
    {"tflops_per_gpu"} (+ "mfu" on a GPU whose peak is known). Collective over the DP ranks."""
    import torch
    from megatron.core import parallel_state

    from glm5_bridge.train.engine import data_parallel_info

    total = 0
    for batch in micro_batches:
        lengths = batch.lengths[:-1] if getattr(batch, "padding_segment", 0) else batch.lengths
        total += step_flops(c, list(lengths))["lora_step"]
    summed = torch.tensor([float(total)], dtype=torch.float64)
    if data_parallel_info()[1] > 1:  # every DP rank trains its own micro-batches; the others share them
        summed = summed.to("cuda" if torch.cuda.is_available() else "cpu")
        torch.distributed.all_reduce(summed, group=parallel_state.get_data_parallel_group())
    per_gpu = summed.item() / seconds / torch.distributed.get_world_size()
    out = {"tflops_per_gpu": per_gpu / 1e12}
    peak = peak_flops(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    if peak:
        out["mfu"] = per_gpu / peak
    return out
