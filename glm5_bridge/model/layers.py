"""The two building blocks our spec needs that megatron-core only offers through Transformer
Engine: a TP-duplicated linear and a norm that works under sequence parallelism."""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


def _param_device(config: TransformerConfig) -> torch.device:
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class DuplicatedLinear(torch.nn.Module):
    """A linear layer whose full weight lives on every TP rank (TE's `parallel_mode="duplicated"`).

    Used for the MLA down-projections (q_a_proj, kv_a_proj_with_mqa) and the indexer projections.
    Under sequence parallelism each rank sees different tokens, so the weight is tagged
    `sequence_parallel` and megatron's grad finalisation sums it over TP. The indexer additionally
    tags its weights `average_gradients_across_tp_domain` (it sees gathered, identical inputs), which
    megatron checks first.
    """

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, init_method=None,
                 bias: bool = False, skip_bias_add: bool = False, skip_weight_param_allocation: bool = False,
                 parallel_mode: str | None = "duplicated", **unused):
        super().__init__()
        if parallel_mode not in (None, "duplicated"):
            raise ValueError(f"DuplicatedLinear cannot be parallel_mode={parallel_mode!r}")
        if skip_weight_param_allocation:
            raise ValueError("DuplicatedLinear always allocates its weight")
        self.config = config
        self.skip_bias_add = skip_bias_add
        device, dtype = _param_device(config), config.params_dtype
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(output_size, device=device, dtype=dtype)) if bias else None
        if config.perform_initialization and init_method is not None:
            with torch.no_grad():
                init_method(self.weight)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Replicated over TP (every rank holds the whole weight): what megatron assumes of a plain
        module, spelled out because a LoRA wrapper asks its base module for this method by name."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {},
                                                   sharded_offsets, dp_cp_group=metadata["dp_cp_group"])

    def forward(self, x: torch.Tensor):
        if self.skip_bias_add:
            return torch.nn.functional.linear(x, self.weight), self.bias
        return torch.nn.functional.linear(x, self.weight, self.bias), None


class Norm:
    """RMSNorm / LayerNorm (per `config.normalization`) from torch, usable with sequence parallel.

    megatron's `WrappedTorchNorm` asserts `not config.sequence_parallel`; the only thing SP needs
    from a norm is that its parameters are tagged so their grads are summed over TP ranks.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused):
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"unsupported normalization {config.normalization!r}")
        norm = norm.to(device=_param_device(config), dtype=config.params_dtype)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


class LatentNorm:
    """The MLA latent norms (q_a_layernorm, kv_a_layernorm). transformers hard-codes their eps to
    1e-6, unlike the decoder norms (`rms_norm_eps`, 1e-5); megatron would pass the latter."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused):
        return Norm(config, hidden_size, eps=getattr(config, "mla_latent_norm_eps", eps))
