"""GLM-5's MLA self-attention: megatron-core's absorbed MLA with a clear refusal of inference."""

from __future__ import annotations

from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention


class GLM5AbsorbedMLA(AbsorbedMLASelfAttention):
    def forward(self, hidden_states, attention_mask, *args, inference_context=None, inference_params=None, **kwargs):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError(
                "GLM-5 DSA attention is training-only: inference_context must be None "
                "(generate with the exported HF checkpoint instead)")
        return super().forward(hidden_states, attention_mask, *args, **kwargs)
