"""The GLM-5 decoder block spec: MLA + DSA attention, dense or MoE MLP, built from plain torch /
megatron-core modules so it builds with or without Transformer Engine.

megatron-core's own DSA spec (`get_transformer_block_with_experimental_attention_variant_spec`)
asserts `transformer_impl == "transformer_engine"`; this one differs from it in four places:
  - q/kv down-projections and the indexer use `DuplicatedLinear` instead of TE's duplicated linear;
  - norms tag their params for sequence parallel instead of refusing it;
  - the MLA latent norms use eps 1e-6 as transformers does;
  - core attention is ours (IndexShare from `indexer_types`, −1 padded top-k, backend switch).
"""

from __future__ import annotations

import copy

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend, get_mlp_module_spec_for_backend
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.enums import AttnMaskType, LayerType
from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from glm5_bridge.compat import HAVE_TE
from glm5_bridge.model.config import check_stage_starts
from glm5_bridge.model.attention.core import SparseMLACoreAttention, SparseMLACoreAttentionSubmodules, indexer_spec
from glm5_bridge.model.attention.mla import GLM5AbsorbedMLA
from glm5_bridge.model.layers import DuplicatedLinear, LatentNorm, Norm


class GLM5SpecProvider(LocalSpecProvider):
    """megatron-core's local (non-TE) modules plus the two TE-only pieces DSA needs."""

    def linear(self) -> type:
        if HAVE_TE:  # upstream's choice for duplicated linears when TE is there
            from megatron.core.extensions.transformer_engine import TELinear

            return TELinear
        return DuplicatedLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        return LatentNorm if (rms_norm and for_qk) else Norm


def attention_spec(config, backend: GLM5SpecProvider, is_mtp_layer: bool = False) -> ModuleSpec:
    latent_norm = backend.layer_norm(rms_norm=True, for_qk=True)
    core = ModuleSpec(module=SparseMLACoreAttention, params={"is_mtp_layer": is_mtp_layer},
                      submodules=SparseMLACoreAttentionSubmodules(indexer=indexer_spec(backend)))
    return ModuleSpec(
        module=GLM5AbsorbedMLA,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=AbsorbedMLASelfAttentionSubmodules(
            linear_q_down_proj=backend.linear(),
            linear_q_up_proj=backend.column_parallel_linear(),
            linear_kv_down_proj=backend.linear(),
            linear_kv_up_proj=backend.column_parallel_linear(),
            core_attention=core,
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=latent_norm,
            kv_layernorm=latent_norm,
        ),
    )


def layer_spec(config, backend: GLM5SpecProvider, moe: bool, is_mtp_layer: bool = False) -> ModuleSpec:
    if moe:
        mlp = get_moe_module_spec_for_backend(backend, num_experts=config.num_moe_experts,
                                              moe_grouped_gemm=config.moe_grouped_gemm)
    else:
        mlp = get_mlp_module_spec_for_backend(backend)
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=backend.layer_norm(rms_norm=True),
        self_attention=attention_spec(config, backend, is_mtp_layer),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=backend.layer_norm(rms_norm=True),
        mlp=mlp,
        mlp_bda=get_bias_dropout_add,
    ))


def local_layer_ids(config, vp_stage=None, pp_rank=None) -> list[int]:
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return list(range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)))


def pipeline_stage_starts(config) -> list[int]:
    """The first decoder layer of every pipeline stage (virtual stages included) that has layers,
    from the config alone: the same list on every rank."""
    layout = config.pipeline_model_parallel_layout
    if layout is not None:  # megatron's offset helpers ignore pp_rank for a layout
        starts, offset = [], 0
        for vp in range(layout.virtual_pipeline_model_parallel_size):
            for pp in range(layout.pipeline_model_parallel_size):
                n = layout.layout[pp][vp].count(LayerType.decoder)
                if n:
                    starts.append(offset)
                offset += n
        return starts
    vp_size = config.virtual_pipeline_model_parallel_size
    return [ids[0] for vp in (range(vp_size) if vp_size else [None])
            for pp in range(config.pipeline_model_parallel_size) if (ids := local_layer_ids(config, vp, pp))]


def glm5_block_spec(config, vp_stage=None, pp_rank=None) -> TransformerBlockSubmodules:
    """The decoder block spec for this pipeline stage (the provider's `transformer_layer_spec`).

    Every stage's start is checked on every rank, so a split on a "shared" layer fails on all ranks
    at build time (checking only the local stage lets the valid stages go on into the first
    collective and wait there for the rank that failed)."""
    backend = GLM5SpecProvider()
    check_stage_starts(config.dsa_indexer_types, pipeline_stage_starts(config))
    layer_ids = local_layer_ids(config, vp_stage, pp_rank)
    moe_pattern = config.moe_layer_freq
    specs = [layer_spec(config, backend, moe=bool(moe_pattern[i])) for i in layer_ids]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=backend.layer_norm(rms_norm=True))


def glm5_mtp_block_spec(config, vp_stage=None):
    """The MTP block spec: megatron's MTP layer around a GLM-5 MoE layer that owns its indexer."""
    if not config.mtp_num_layers:
        return None
    mtp_layer = layer_spec(config, GLM5SpecProvider(), moe=bool(config.moe_layer_freq[-1]), is_mtp_layer=True)
    return get_gpt_mtp_block_spec_for_backend(config, copy.deepcopy(mtp_layer), GLM5SpecProvider(),
                                              vp_stage=vp_stage)
