"""LoRA for GLM-5 on megatron-bridge's PEFT (`LoRA`, `LoRALinear`, `ParallelLinearAdapter`).

    from glm5_bridge.train.lora import GLM5LoRA, lora_targets
    lora = GLM5LoRA(dim=16, alpha=32)                       # MLA projections (the default)
    lora = GLM5LoRA(target_modules=lora_targets(dense_mlp=True, shared_experts=True))
    model = lora(model)                                     # freezes the base, adds adapters

Three things differ from upstream's `LoRA`, each because of how GLM-5's attention is built:

1. The q/kv down-projections (HF q_a_proj, kv_a_proj_with_mqa) are our `DuplicatedLinear`: a full
   weight on every TP rank, fed the rank's own tokens (sequence parallel). Upstream has no adapter
   attributes for that class, and its adapter for TE's duplicated linear would `gather_output`
   along the feature dim across ranks that hold *different tokens*. `DuplicatedLinearAdapter`
   keeps upstream's storage (A and B as TP shards, so export and checkpoints work unchanged) but
   gathers the LoRA *weights* (autograd-aware: all-gather forward, reduce-scatter backward) and
   applies them to the local tokens.
2. kv_b_proj (linear_kv_up_proj) is never called as a layer in absorbed MLA: its weight is split
   into W_UK / W_UV and folded into q and into the attention output. `effective_weight`
   (model/lora_fold.py, since the model's attention calls it) gives
   base + (alpha/r)·B·A as a differentiable tensor so both A and B train; at TP > 1 it gathers the
   sharded A with an autograd-aware gather (upstream's `LoRALinear.weight` uses a plain
   `dist.all_gather` there, so A silently gets no gradient). attention/mla.py calls it, and our
   wrappers (`GLM5LoRALinear`) return it as their `.weight`.
3. The DSA indexer runs under `torch.no_grad` (attention/core.py), so it is never a default target
   and targeting it warns: an indexer adapter gets no gradient and stays at its initialisation.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

import torch

from glm5_bridge import compat
from glm5_bridge.model.layers import DuplicatedLinear

with compat.megatron_bridge_without_te():  # compat item 1
    from megatron.bridge.peft.lora import LoRA
    from megatron.bridge.peft.lora_layers import LoRALinear
    from megatron.bridge.peft.utils import ParallelLinearAdapter, wildcard_match

from glm5_bridge.model.lora_fold import effective_weight, gather_rows

logger = logging.getLogger(__name__)

# Megatron module names of the GLM-5 projections (HF name in the comment).
MLA_TARGETS = (
    "linear_q_down_proj",   # q_a_proj
    "linear_q_up_proj",     # q_b_proj
    "linear_kv_down_proj",  # kv_a_proj_with_mqa
    "linear_kv_up_proj",    # kv_b_proj (folded into W_UK / W_UV)
    "linear_proj",          # o_proj
)
DENSE_MLP_TARGETS = ("*.mlp.linear_fc1", "*.mlp.linear_fc2")  # gate_proj+up_proj, down_proj
SHARED_EXPERT_TARGETS = ("*.mlp.shared_experts.linear_fc1", "*.mlp.shared_experts.linear_fc2")
EXPERT_TARGETS = ("*.mlp.experts.local_experts.*.linear_fc1", "*.mlp.experts.local_experts.*.linear_fc2")
INDEXER_TARGETS = ("*.indexer.linear_wq_b", "*.indexer.linear_wk", "*.indexer.linear_weights_proj")

# HF projection names accepted in `target_modules` as aliases of the Megatron names.
HF_TO_MEGATRON = {
    "q_a_proj": "linear_q_down_proj",
    "q_b_proj": "linear_q_up_proj",
    "kv_a_proj_with_mqa": "linear_kv_down_proj",
    "kv_b_proj": "linear_kv_up_proj",
    "o_proj": "linear_proj",
    "wq_b": "*.indexer.linear_wq_b",
    "wk": "*.indexer.linear_wk",
    "weights_proj": "*.indexer.linear_weights_proj",
}

INDEXER_WARNING = (
    "LoRA targets {n} DSA indexer projection(s) (e.g. {example}). The indexer runs under "
    "torch.no_grad (glm5_bridge/model/attention/core.py): these adapters get no gradient and stay at "
    "their initialisation. Remove the indexer from target_modules.")


def lora_targets(mla: bool = True, dense_mlp: bool = False, shared_experts: bool = False,
                 experts: bool = False, indexer: bool = False) -> list[str]:
    """`target_modules` for a choice of GLM-5 module groups (MLA only by default).

    `dense_mlp` covers the first_k_dense_replace dense layers only; the routed experts and the
    shared expert of MoE layers are separate groups. `indexer` adapters get no gradient (see
    module docstring) and are only useful for experiments that train it by other means.
    """
    groups = ((mla, MLA_TARGETS), (dense_mlp, DENSE_MLP_TARGETS), (shared_experts, SHARED_EXPERT_TARGETS),
              (experts, EXPERT_TARGETS), (indexer, INDEXER_TARGETS))
    return [t for on, targets in groups if on for t in targets]


class GLM5LoRALinear(LoRALinear):
    """upstream `LoRALinear` whose `weight` (base + LoRA delta) is differentiable w.r.t. A and B at
    any TP size and also right for duplicated bases (upstream's merge detaches A at TP > 1 and
    mis-shapes the delta of a duplicated base)."""

    @property
    def weight(self) -> torch.Tensor:
        return effective_weight(self)


class DuplicatedLinearAdapter(ParallelLinearAdapter):
    """LoRA for a `DuplicatedLinear` base (full weight on every TP rank, local tokens under SP).

    Storage is upstream's (A: [r/tp, in], B: [out/tp, r] column shards), so adapter export and
    distributed checkpoints treat it like any other adapter. The forward applies the full A and B
    to this rank's tokens; gathering the weights (not the activations) keeps tokens and features
    aligned, and the reduce-scatter in backward sums the weight grads over every rank's tokens.
    """

    def __init__(self, base: DuplicatedLinear, dim: int, base_linear_name: str, **kwargs):
        out_features, in_features = base.weight.shape
        super().__init__(in_features, out_features, dim, base_linear_name, activation="identity",
                         input_is_parallel=False, model_parallel_config=base.config, is_expert=False,
                         disable_sequence_parallel_comm=True, base_linear_is_parallel=False, **kwargs)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.dropout_position == "pre":
            x = self.dropout(x)
        a = gather_rows(self.linear_in.weight, self.tp_group)
        b = gather_rows(self.linear_out.weight, self.tp_group)
        x = torch.nn.functional.linear(self.activation(torch.nn.functional.linear(x, a)), b)
        if self.dropout_position == "post":
            x = self.dropout(x)
        return x * (self.alpha / self.dim)


@dataclass
class GLM5LoRA(LoRA):
    """megatron-bridge `LoRA` with GLM-5 defaults (MLA projections) and support for our
    duplicated down-projections. HF names (q_a_proj, kv_b_proj, …) are accepted as aliases.
    All other behaviour (freezing, matching, wildcards, export through AutoBridge) is upstream's.
    """

    target_modules: list[str] = field(default_factory=lambda: list(MLA_TARGETS))

    def __call__(self, model, training: bool = True):
        self.target_modules = [HF_TO_MEGATRON.get(t, t) for t in (self.target_modules or [])]
        self._indexer_hits: list[str] = []
        model = super().__call__(model, training=training)
        if self._indexer_hits:
            message = INDEXER_WARNING.format(n=len(self._indexer_hits), example=self._indexer_hits[0])
            logger.warning(message)
            warnings.warn(message, UserWarning, stacklevel=2)
        return model

    def match(self, m, name=None, prefix=None):
        # Upstream's exclude_modules mode (empty target_modules) only considers megatron/torch linear
        # classes; include the duplicated down-projections there too, but never the indexer.
        if not self.target_modules and not self.canonical_mapping and isinstance(m, DuplicatedLinear):
            full_name = f"{prefix}.{name}" if prefix else name
            if ".indexer." in f".{full_name}" or name in self.exclude_modules or any(
                    wildcard_match(p, full_name) for p in self.exclude_modules):
                return None
            self._record_match(name, full_name)
            return name, full_name
        return super().match(m, name, prefix)

    def transform(self, module, name=None, prefix=None):
        if not isinstance(module, DuplicatedLinear):
            wrapped = super().transform(module, name, prefix)
            if type(wrapped) is LoRALinear:
                wrapped = GLM5LoRALinear(wrapped.to_wrap, wrapped.adapter)
                if name == "linear_kv_up_proj" and self.dropout > 0:
                    warnings.warn("LoRA dropout is not applied to linear_kv_up_proj (kv_b_proj): absorbed MLA "
                                  "folds its LoRA into the weight, which has no input to drop.", UserWarning)
            return wrapped
        ans = self.match(module, name, prefix)
        if ans is None:
            return module
        full_name = ans[1]
        if ".indexer." in f".{full_name}":
            self.__dict__.setdefault("_indexer_hits", []).append(full_name)
        logger.info("Adding lora to: %s", full_name)
        adapter = DuplicatedLinearAdapter(
            module, self.dim, full_name, column_init_method=self.lora_A_init_method,
            row_init_method=self.lora_B_init_method, dropout=self.dropout,
            dropout_position=self.dropout_position, alpha=self.alpha)
        return GLM5LoRALinear(module, adapter)


def apply_lora(model, lora: GLM5LoRA | None = None, training: bool = True):
    """Apply `lora` (default: `GLM5LoRA()`) to a model chunk or a list of chunks; returns the model
    with the base frozen and only adapter parameters trainable."""
    return (lora or GLM5LoRA())(model, training=training)


def lora_parameters(model) -> dict[str, torch.nn.Parameter]:
    """name → parameter for every adapter parameter (what an optimizer should train)."""
    chunks = model if isinstance(model, list) else [model]
    return {name: p for chunk in chunks for name, p in chunk.named_parameters() if ".adapter." in name}


def init_adapters_by_name(chunk, seed: int) -> None:
    """Draw every LoRA A (xavier-uniform over the adapter's whole, unsharded matrix) from a generator
    seeded by the run's seed and the adapter's global checkpoint name, and zero every B. Each rank
    then holds its shard of the same adapters at any TP / PP / EP layout — where drawing from one
    stream in module order would give a pipeline stage other numbers than the same layers get in one
    process — so layouts train alike. The names and shards are the distributed checkpoint's."""
    import zlib

    with torch.no_grad():
        for tensor in chunk.sharded_state_dict().values():
            key = getattr(tensor, "key", "")
            if ".adapter." not in key or key.endswith("_extra_state") or not hasattr(tensor, "global_shape"):
                continue
            local = tensor.data
            if ".linear_out." in key:
                local.zero_()
                continue
            pre = tensor.prepend_axis_num  # leading axes that index a stack (experts), not the matrix
            tag = f"{seed}:{key}:{tuple(tensor.global_offset[:pre])}".encode()
            full = torch.empty(tensor.global_shape[pre:], dtype=torch.float32)
            torch.nn.init.xavier_uniform_(full, generator=torch.Generator().manual_seed(zlib.crc32(tag)))
            window = tuple(slice(o, o + n) for o, n in zip(tensor.global_offset[pre:], local.shape))
            local.copy_(full[window].to(local.dtype))
