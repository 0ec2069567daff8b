"""Per-GPU memory plan for LoRA training of a GLM-5.x config: a parameter count from config.json
(checked against real checkpoints in tests/test_plan.py) and how TP / PP / EP / CP shard it.

Assumptions, stated so that a reader can redo the sums:
  - frozen base weights in bf16 (2 B/param) without grads or optimizer state;
  - LoRA adapters with fp32 params, grads and two Adam moments (16 B/param);
  - TP shards attention heads, the dense/shared MLPs, embedding and LM head; the MLA
    down-projections, the indexer and all norms are duplicated on every TP rank (as in our spec);
  - EP shards the routed experts (expert TP = 1); PP splits decoder layers evenly, the embedding on
    the first stage, the LM head and the MTP layer on the last;
  - activations with full recompute: one bf16 hidden state per layer and token kept, plus the
    working set of one layer (attention latents, sparse-attention top-k, the MoE dispatch buffers);
    sequence parallel splits tokens by TP, CP by CP.
"""

from __future__ import annotations

from dataclasses import dataclass

from glm5_bridge.model.config import check_stage_starts, indexer_types, num_mtp_layers

GIB = 1024**3


def layer_params(c, moe: bool, indexer: bool) -> dict[str, int]:
    """Parameters of one decoder layer by group."""
    h, heads = c.hidden_size, c.num_attention_heads
    nope, rope, v = c.qk_nope_head_dim, c.qk_head_dim - c.qk_nope_head_dim, c.v_head_dim
    attn_split = c.q_lora_rank * heads * (nope + rope) + c.kv_lora_rank * heads * (nope + v) + heads * v * h
    attn_dup = h * c.q_lora_rank + c.q_lora_rank + h * (c.kv_lora_rank + rope) + c.kv_lora_rank + 2 * h
    idx = 0
    if indexer:
        idx = c.q_lora_rank * c.index_n_heads * c.index_head_dim + h * c.index_head_dim \
            + 2 * c.index_head_dim + h * c.index_n_heads
    if moe:
        experts = c.n_routed_experts * 3 * h * c.moe_intermediate_size
        mlp_split = c.n_shared_experts * 3 * h * c.moe_intermediate_size
        mlp_dup = c.n_routed_experts * h + c.n_routed_experts  # router + correction bias
    else:
        experts, mlp_split, mlp_dup = 0, 3 * h * c.intermediate_size, 0
    return {"tp_split": attn_split + mlp_split, "duplicated": attn_dup + idx + mlp_dup, "experts": experts}


def count_parameters(c) -> dict[str, int]:
    """Total parameters of the HF checkpoint (decoder, embeddings, MTP), and active per token."""
    types = indexer_types(c)
    dense = c.first_k_dense_replace
    decoder = [layer_params(c, moe=i >= dense, indexer=types[i] == "full") for i in range(c.num_hidden_layers)]
    embed = c.vocab_size * c.hidden_size
    mtp = num_mtp_layers(c) * (sum(layer_params(c, moe=True, indexer=True).values())
                               + 2 * c.hidden_size * c.hidden_size + 3 * c.hidden_size)
    total = sum(sum(d.values()) for d in decoder) + 2 * embed + c.hidden_size + mtp
    active_experts = sum(d["experts"] for d in decoder) * c.num_experts_per_tok // c.n_routed_experts
    active = total - mtp - sum(d["experts"] for d in decoder) + active_experts
    return {"total": total, "decoder": sum(sum(d.values()) for d in decoder), "embeddings": 2 * embed,
            "mtp": mtp, "active_per_token": active}


def lora_params(c, dim: int) -> int:
    """LoRA on the five MLA projections of every decoder layer (the default targets)."""
    h, heads = c.hidden_size, c.num_attention_heads
    nope, rope, v = c.qk_nope_head_dim, c.qk_head_dim - c.qk_nope_head_dim, c.v_head_dim
    shapes = [(h, c.q_lora_rank), (c.q_lora_rank, heads * (nope + rope)), (h, c.kv_lora_rank + rope),
              (c.kv_lora_rank, heads * (nope + v)), (heads * v, h)]
    return c.num_hidden_layers * sum(dim * (i + o) for i, o in shapes)


@dataclass
class Plan:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    seq_len: int = 16384  # tokens per micro-batch
    lora_dim: int = 64
    stage_layers: tuple[int, ...] | None = None  # decoder layers per PP stage; None = even split


def pipeline_stages(c, plan: Plan) -> list[range]:
    """Decoder layers of each PP stage; raises if a stage would start on a shared layer."""
    n = c.num_hidden_layers
    sizes = list(plan.stage_layers) if plan.stage_layers else None
    if sizes is None:
        if n % plan.pp:
            raise ValueError(f"{n} layers do not split evenly into PP={plan.pp} stages; give the stage sizes")
        sizes = [n // plan.pp] * plan.pp
    if len(sizes) != plan.pp or sum(sizes) != n or min(sizes) < 1:
        raise ValueError(f"stage sizes {sizes} must be {plan.pp} positive numbers summing to {n}")
    starts = [sum(sizes[:i]) for i in range(plan.pp)]
    check_stage_starts(indexer_types(c), starts)
    return [range(a, a + n_) for a, n_ in zip(starts, sizes)]


def memory_per_gpu(c, plan: Plan) -> dict[str, float]:
    """GiB on the busiest GPU (the pipeline stage with the most memory)."""
    if c.num_attention_heads % plan.tp or c.n_routed_experts % plan.ep:
        raise ValueError(f"TP={plan.tp} must divide {c.num_attention_heads} heads and EP={plan.ep} "
                         f"{c.n_routed_experts} experts")
    types = indexer_types(c)
    stages = pipeline_stages(c, plan)

    def sharded(g):
        return g["tp_split"] / plan.tp + g["duplicated"] + g["experts"] / plan.ep

    heads_local = c.num_attention_heads / plan.tp
    full_tokens = plan.seq_len / plan.cp
    tokens = full_tokens / plan.tp  # sequence parallel
    layer_ws = (full_tokens * heads_local * (576 + 512 + c.qk_nope_head_dim + c.v_head_dim) * 2  # q, out, up-proj
                + full_tokens * c.index_topk * 8  # top-k indices (int64)
                + full_tokens * c.num_experts_per_tok * c.hidden_size * 2 * 2 / plan.tp)  # MoE dispatch in/out
    # the indexer's fp32 score block: a row block of this rank's queries against their whole window,
    # at most ROW_BLOCK rows (kernels/indexer.py); an upper bound since its BLOCK_BYTES budget keeps
    # blocks at long windows smaller
    from glm5_bridge.kernels.indexer import ROW_BLOCK

    layer_ws += min(ROW_BLOCK, full_tokens) * plan.seq_len * 4
    if plan.cp > 1:  # one layer's gathered sequence: latent kv rows and indexer keys, in bf16
        layer_ws += plan.seq_len * (c.kv_lora_rank + (c.qk_head_dim - c.qk_nope_head_dim) + c.index_head_dim) * 2
    lora_per_layer = lora_params(c, plan.lora_dim) / c.num_hidden_layers / plan.tp
    best = None
    for s, layers in enumerate(stages):
        weights = sum(sharded(layer_params(c, moe=i >= c.first_k_dense_replace, indexer=types[i] == "full"))
                      for i in layers)
        acts = len(layers) * tokens * c.hidden_size * 2 + layer_ws
        if s == 0:
            weights += c.vocab_size * c.hidden_size / plan.tp
        if s == len(stages) - 1:  # LM head, MTP layer, fp32 vocab-parallel logits for the loss
            weights += c.vocab_size * c.hidden_size / plan.tp
            weights += num_mtp_layers(c) * (sharded(layer_params(c, moe=True, indexer=True))
                                            + 2 * c.hidden_size**2 / plan.tp)
            acts += full_tokens * c.vocab_size / plan.tp * 4
        lora = len(layers) * lora_per_layer
        row = {"stage": s, "weights_bf16": weights * 2 / GIB, "lora_params_grads_adam": lora * 16 / GIB,
               "activations": acts / GIB}
        row["total"] = row["weights_bf16"] + row["lora_params_grads_adam"] + row["activations"]
        if best is None or row["total"] > best["total"]:
            best = row
    return best


# Memory of one GPU as torch reports it (GiB), by the name `plan --gpu` takes.
GPU_MEMORY_GIB = {"H100": 79.2, "H200": 139.8, "A100": 79.2, "B200": 178.4}
# The share of a GPU's memory a plan may fill: the estimate leaves out the CUDA context, the
# allocator's fragmentation, communication buffers and the kernels' workspaces.
USABLE = 0.9


def verdict(c, plan: Plan, gpu_memory_gib: float) -> tuple[bool, str]:
    """(fits, one line with the numbers) for this layout on GPUs of that much memory."""
    m = memory_per_gpu(c, plan)
    budget = USABLE * gpu_memory_gib
    fits = m["total"] <= budget
    return fits, (f"{'fits' if fits else 'does not fit'}: the busiest GPU (PP stage {m['stage']}) needs "
                  f"{m['total']:.1f} GiB (weights {m['weights_bf16']:.1f}, LoRA + Adam "
                  f"{m['lora_params_grads_adam']:.1f}, activations {m['activations']:.1f}); "
                  f"{budget:.1f} of {gpu_memory_gib:.1f} GiB usable")


def longest_sequence(c, plan: Plan, gpu_memory_gib: float, step: int = 1024) -> int:
    """The longest micro-batch (a multiple of `step` tokens) this layout fits on GPUs of that much
    memory by memory_per_gpu's estimate; 0 if not even `step` tokens fit."""
    from dataclasses import replace

    def fits(n):
        return verdict(c, replace(plan, seq_len=n), gpu_memory_gib)[0]

    if not fits(step):
        return 0
    low, high = step, 2 * step
    while fits(high) and high < 2**26:
        low, high = high, 2 * high
    while high - low > step:
        mid = (low + high) // 2 // step * step
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def recipe_plan(recipe) -> Plan:
    m = recipe.model
    return Plan(tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size, ep=m.expert_model_parallel_size,
                cp=m.context_parallel_size, seq_len=recipe.data.max_tokens, lora_dim=recipe.lora.dim,
                stage_layers=tuple(m.pipeline_stage_layers) or None)


def check_recipe_fits(recipe, hf_config) -> None:
    """Before the model is built: refuse a layout that cannot fit this GPU (train.gpu_memory_gib, or
    the device's own memory), in one line with the numbers. Nothing to check on a CPU."""
    import torch

    gib = recipe.train.gpu_memory_gib
    if not gib and torch.cuda.is_available():
        gib = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB
    if not gib:
        return
    plan = recipe_plan(recipe)
    fits, line = verdict(hf_config, plan, gib)
    if not fits:
        raise ValueError(f"layout TP {plan.tp} PP {plan.pp} EP {plan.ep} at data.max_tokens {plan.seq_len} "
                         f"{line}; raise model.pipeline_model_parallel_size or expert_model_parallel_size, or "
                         "lower data.max_tokens")
