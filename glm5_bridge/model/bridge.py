"""Our GLM-5 bridge: megatron-bridge's `GLM5Bridge` with the config translation fixed and the
model built from our spec. Registered for `GlmMoeDsaForCausalLM` when `glm5_bridge` is imported,
so `AutoBridge.from_hf_pretrained(path)` dispatches here.

What differs from upstream's provider_bridge, each a deliberate choice:
  - missing keys take transformers' defaults (`indexer_rope_interleave`, IndexShare offset 2);
  - IndexShare comes from `indexer_types` / `index_topk_pattern` / freq+offset (config.py);
  - the MTP layer is built and converted (upstream disables it);
  - our block spec (spec.py) instead of megatron-core's TE-only DSA spec;
  - MoE settings that run everywhere (upstream's defaults need TE and HybridEP);
  - the MLA latent norms use eps 1e-6, as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from transformers import GlmMoeDsaForCausalLM

from glm5_bridge import compat

with compat.megatron_bridge_without_te():  # compat item 1
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge as MegatronAutoBridge
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
    from megatron.bridge.models.conversion.param_mapping import AutoMapping
    from megatron.bridge.models.glm_moe_dsa.glm5_bridge import GLM5Bridge as UpstreamGLM5Bridge
    from megatron.bridge.models.mla_provider import MLAModelProvider

from glm5_bridge.model import config as cfg
from glm5_bridge.model.attention.backends import BACKENDS
from glm5_bridge.model.layers import DuplicatedLinear
from glm5_bridge.model.source import Source, resolve
from glm5_bridge.model.spec import glm5_block_spec, glm5_mtp_block_spec
from glm5_bridge.model.validate import validate_checkpoint


# The duplicated linear holds the full weight on every TP rank.
AutoMapping.register_module_type("DuplicatedLinear", "replicated")


@dataclass
class GLM5ModelProvider(MLAModelProvider):
    """MLA provider with the GLM-5 DSA fields our spec reads."""

    transformer_layer_spec: object = glm5_block_spec
    # "megatron": unfused torch (default, runs on CPU); "tilelang": fused kernels (GPU, thd only).
    dsa_attention_backend: str = "megatron"
    # TP > 1: the sparse attention split by query tokens instead of heads (attention/token_parallel.py);
    # None: on with the "tilelang" backend without context parallelism (token_parallel.enabled)
    dsa_token_parallel: bool | None = None
    # Per decoder layer "full" / "shared" (IndexShare); None = every layer computes its top-k.
    dsa_indexer_types: list | None = None
    mla_latent_norm_eps: float = 1e-6
    # The checkpoint the weights come from (set by AutoBridge.to_megatron_provider when it loads
    # them): the loaded weights are checked finite and a failure names it.
    weights_source: str | None = None

    def finalize(self) -> None:
        if self.dsa_attention_backend not in BACKENDS:
            raise ValueError(f"dsa_attention_backend must be one of {BACKENDS}, got {self.dsa_attention_backend!r}")
        if self.dsa_indexer_types is None:
            self.dsa_indexer_types = ["full"] * self.num_layers
        super().finalize()

    def provide(self, *args, **kwargs):
        with compat.provider_mtp_spec(self), compat.absorbed_mla_duplicated_linear(DuplicatedLinear):  # items 3, 5
            return super().provide(*args, **kwargs)

    def provide_distributed_model(self, *args, **kwargs):
        if not torch.cuda.is_available():
            compat.enable_cpu_support()
            compat.init_cpu_process_group()
            kwargs["use_cpu_initialization"] = True
        chunks = super().provide_distributed_model(*args, **kwargs)
        if self.weights_source is not None:
            check_finite_weights(chunks, self.weights_source)
        return chunks

    def initialize_model_parallel(self, seed=None, seed_kwargs=None, **model_parallel_kwargs):
        if torch.cuda.is_available():
            return super().initialize_model_parallel(seed, seed_kwargs, **model_parallel_kwargs)
        compat.init_cpu_process_group()
        super().initialize_model_parallel(None, None, **model_parallel_kwargs)
        if seed is not None:
            compat.cpu_seed(seed)

    def build_mtp_block_spec(self, vp_stage=None):
        """Called instead of megatron-bridge's TE-only MTP spec (compat item 3)."""
        return glm5_mtp_block_spec(self, vp_stage=vp_stage)


def check_finite_weights(chunks, source: str) -> None:
    """Refuse weights holding NaN or Inf, naming the first such tensor: poisoned base weights would
    otherwise train to NaN and export NaN. Cost: one read of this rank's weights (a float32 sum per
    tensor, all compared at once; a NaN or Inf makes the sum non-finite), with no copy of them."""
    named = [(name, t) for chunk in chunks for name, t in (*chunk.named_parameters(), *chunk.named_buffers())
             if t.is_floating_point() and t.numel()]
    if not named:
        return
    with torch.no_grad():
        finite = torch.stack([t.sum(dtype=torch.float32) for _, t in named]).isfinite().tolist()
        bad = [(name, int((~t.isfinite()).sum())) for (name, t), ok in zip(named, finite) if not ok]
    bad = [(name, count) for name, count in bad if count]  # a sum can overflow without a NaN or Inf
    if bad:
        name, count = bad[0]
        raise ValueError(f"{source}: non-finite weights: {count} NaN/Inf value(s) in {name} (Megatron name; "
                         f"{len(bad)} tensor(s) in all); the checkpoint is corrupt")


@MegatronModelBridge.register_bridge(
    source=GlmMoeDsaForCausalLM, target=GPTModel, provider=GLM5ModelProvider, model_type="glm_moe_dsa"
)
class GLM5Bridge(UpstreamGLM5Bridge):
    """GLM-5 / 5.1 / 5.2 ↔ Megatron GPTModel. Weight mappings are upstream's (they already cover
    the indexer and the MTP layer); only the config translation is ours."""

    def provider_bridge(self, hf_pretrained) -> GLM5ModelProvider:
        # Upstream's provider_bridge reads `indexer_rope_interleave` bare and hard-codes GPU-only
        # settings, so the generic HF→Megatron field mapping is taken from the base class and the
        # GLM-5 specifics are set here in full.
        p = MegatronModelBridge.provider_bridge(self, hf_pretrained)
        hf = hf_pretrained.config
        on_gpu = torch.cuda.is_available()

        p.transformer_layer_spec = glm5_block_spec
        p.transformer_impl = "local"
        p.normalization = "RMSNorm"
        p.gated_linear_unit = True
        p.add_bias_linear = False
        p.share_embeddings_and_output_weights = False
        p.qk_layernorm = True
        p.multi_latent_attention = True
        p.hidden_dropout = 0.0
        p.attention_softmax_in_fp32 = True
        p.make_vocab_size_divisible_by = 1280

        # RoPE: default rope (no YaRN); the rope width is qk_head_dim − qk_nope_head_dim because
        # transformers rewrites head_dim / qk_rope_head_dim for GLM-5.2 on load.
        p.rope_type = "rope"
        p.rotary_base = cfg.rope_theta(hf)
        p.rotary_scaling_factor = 1.0
        p.mscale = 1.0
        p.mscale_all_dim = 1.0
        p.qk_pos_emb_head_dim = hf.qk_head_dim - hf.qk_nope_head_dim
        if not cfg.rope_interleave(hf):
            raise NotImplementedError(
                "config.json: rope_interleave=false is not supported (megatron-core's absorbed MLA always "
                "applies interleaved rope; every published GLM-5 config says true)")

        # MoE: sigmoid router with correction bias, first_k_dense_replace dense layers.
        p.moe_layer_freq = [0] * hf.first_k_dense_replace + [1] * (hf.num_hidden_layers - hf.first_k_dense_replace)
        p.moe_shared_expert_intermediate_size = hf.moe_intermediate_size * hf.n_shared_experts
        p.moe_router_score_function = "sigmoid"
        p.moe_router_enable_expert_bias = True
        p.moe_router_bias_update_rate = 0.0  # fine-tuning must not move the base model's bias
        p.moe_router_pre_softmax = True
        p.moe_router_dtype = "fp32"
        p.moe_router_load_balancing_type = "seq_aux_loss"
        p.moe_grouped_gemm = False  # SequentialMLP: grouped GEMM needs TE
        p.moe_permute_fusion = False  # needs TE
        p.moe_shared_expert_overlap = False
        # allgather runs on CPU (alltoall creates CUDA streams); alltoall is the GPU default.
        p.moe_token_dispatcher_type = "alltoall" if on_gpu else "allgather"

        # MTP: kept (upstream drops it) so that conversion is lossless.
        p.mtp_num_layers = cfg.num_mtp_layers(hf) or None

        # DSA
        p.experimental_attention_variant = "dsa"
        p.dsa_indexer_head_dim = hf.index_head_dim
        p.dsa_indexer_n_heads = hf.index_n_heads
        p.dsa_indexer_topk = hf.index_topk
        p.dsa_indexer_rope_interleaved = cfg.indexer_rope_interleave(hf)
        p.dsa_indexer_types = cfg.indexer_types(hf)
        p.dsa_indexer_rotate_activation = False
        p.dsa_indexer_k_norm_epsilon = 1e-6
        p.dsa_indexer_loss_coeff = 0.0
        p.mla_latent_norm_eps = 1e-6

        # Runs anywhere: CPU params when there is no GPU; no fusions that need CUDA/TE.
        p.use_cpu_initialization = not on_gpu
        p.gradient_accumulation_fusion = False
        p.masked_softmax_fusion = False
        p.bias_activation_fusion = False
        p.bias_dropout_fusion = False
        p.apply_rope_fusion = False
        p.cross_entropy_loss_fusion = False
        return p


class AutoBridge(MegatronAutoBridge):
    """megatron-bridge's AutoBridge that also accepts the presets "GLM-5", "GLM-5.1", "GLM-5.2"
    (config only, shipped with the package) and checkpoint folders without weights."""

    @classmethod
    def from_hf_pretrained(cls, path, **kwargs):
        source = path if isinstance(path, Source) else resolve(path)
        if not source.has_weights:
            from transformers import GlmMoeDsaConfig

            bridge = cls.from_hf_config(GlmMoeDsaConfig(**source.config))
            bridge.config_only_source = source.name
            return bridge
        return super().from_hf_pretrained(str(source.folder), **kwargs)

    def to_megatron_provider(self, load_weights: bool = True, hf_path=None):
        source = getattr(self, "config_only_source", None)
        if load_weights and hf_path is None and source is not None:
            raise ValueError(f"{source!r} has a config but no weights here; pass the local path of the "
                             "downloaded checkpoint (or load_weights=False for a randomly initialised model)")
        provider = super().to_megatron_provider(load_weights, hf_path)
        if load_weights and isinstance(provider, GLM5ModelProvider):
            loaded_from = hf_path or getattr(getattr(self, "hf_pretrained", None), "model_name_or_path", None)
            provider.weights_source = str(loaded_from or "the checkpoint")
        return provider


def build_megatron_model(path, load_weights: bool = True, **provider_overrides):
    """(bridge, model chunk) for an HF checkpoint folder or preset, through the standard
    megatron-bridge calls; `provider_overrides` set provider fields first (e.g.
    `dsa_attention_backend="tilelang"`, `tensor_model_parallel_size=2`). A checkpoint folder is
    checked first (validate.py: config.json and safetensors headers against each other), so a bad
    one fails with one line naming the file and tensor instead of deep in the weight loading."""
    source = resolve(path)
    if source.folder is not None:
        validate_checkpoint(source, weights=load_weights)
    bridge = AutoBridge.from_hf_pretrained(source)
    provider = bridge.to_megatron_provider(load_weights=load_weights)
    for key, value in provider_overrides.items():
        if not hasattr(provider, key):
            raise AttributeError(f"unknown provider field {key!r}")
        setattr(provider, key, value)
    provider.finalize()
    return bridge, provider.provide_distributed_model(wrap_with_ddp=False)[0]
