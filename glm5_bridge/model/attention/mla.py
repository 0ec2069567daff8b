"""GLM-5's MLA self-attention: megatron-core's absorbed MLA with a clear refusal of inference and
kv_b_proj LoRA folded into W_UK / W_UV."""

from __future__ import annotations

from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention

from glm5_bridge.model.lora_fold import effective_weight


class GLM5AbsorbedMLA(AbsorbedMLASelfAttention):
    def forward(self, hidden_states, attention_mask, *args, inference_context=None, inference_params=None, **kwargs):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError(
                "GLM-5 DSA attention is training-only: inference_context must be None "
                "(generate with the exported HF checkpoint instead)")
        return super().forward(hidden_states, attention_mask, *args, **kwargs)

    def _get_kv_up_weights(self):
        """W_UK [H, qk_head_dim, kv_lora_rank] and W_UV [H, v_head_dim, kv_lora_rank] of the local
        heads. kv_b_proj (linear_kv_up_proj) is only ever used through this weight, so a LoRA on it
        is folded in here: base + (alpha/r)·B·A, differentiable w.r.t. A and B, with the TP-sharded A
        gathered autograd-aware (upstream's `LoRALinear.weight` gathers it with a plain all_gather,
        which leaves A without gradient at TP > 1)."""

        heads, qk, v = self.num_attention_heads_per_partition, self.config.qk_head_dim, self.config.v_head_dim
        weight = effective_weight(self.linear_kv_up_proj)
        if tuple(weight.shape) != (heads * (qk + v), self.config.kv_lora_rank):
            raise RuntimeError(f"linear_kv_up_proj weight {tuple(weight.shape)}: expected "
                               f"{(heads * (qk + v), self.config.kv_lora_rank)}")
        kv_up = weight.view(heads, qk + v, self.config.kv_lora_rank)
        return kv_up[:, :qk, :], kv_up[:, qk:, :]
