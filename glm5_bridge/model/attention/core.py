"""DSA core attention for GLM-5: pick each query's top-k keys, then attend only to those.

`AbsorbedMLASelfAttention` (megatron-core) projects q/kv and calls this module with the absorbed
latent query [.., H, 576] and the single-head key [.., 1, 576]; this module returns the latent
output [.., H·512] and megatron applies W_UV and o_proj.

Top-k comes from exactly one of: this layer's indexer ("full" layers and the MTP layer), or the
source layer's top-k of the same forward (IndexShare "shared" layers). The attention itself runs
on the backend chosen by `config.dsa_attention_backend`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.utils import get_pg_size

from glm5_bridge.model import replay
from glm5_bridge.model.attention import context_parallel, index_share, token_parallel
from glm5_bridge.model.attention.backends import get_backend, topk_selector
from glm5_bridge.model.attention.topk import flat_starts, select_topk_split, sequence_lengths
from glm5_bridge.model.config import topk_source_layers


@dataclass
class SparseMLACoreAttentionSubmodules:
    indexer: ModuleSpec | type = None


class SparseMLACoreAttention(MegatronModule):
    # megatron's AbsorbedMLA applies W_UV itself when the core returns the latent output.
    consumes_absorbed_v_up_projection = False

    def __init__(self, config, submodules: SparseMLACoreAttentionSubmodules, layer_number: int,
                 attn_mask_type=None, attention_type: str = "self", attention_dropout=None,
                 softmax_scale: float | None = None, k_channels=None, v_channels=None,
                 cp_comm_type=None, pg_collection=None, is_mtp_layer: bool = False):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.is_mtp_layer = is_mtp_layer
        self.index_topk = config.dsa_indexer_topk
        self.softmax_scale = softmax_scale
        self.v_channels = config.kv_lora_rank
        self.backend = get_backend(config.dsa_attention_backend)
        self.select_topk = topk_selector(config.dsa_attention_backend)
        self.pg_collection = pg_collection
        self.cp = get_pg_size(pg_collection.cp)  # context parallel: attention/context_parallel.py
        self.token_parallel = token_parallel.enabled(getattr(config, "dsa_token_parallel", None),
                                                     config.dsa_attention_backend, get_pg_size(pg_collection.tp), self.cp)

        types = config.dsa_indexer_types
        # The MTP layer numbers itself 1, 2, … (megatron's convention) and always owns an indexer.
        self.computes_topk = is_mtp_layer or types[layer_number - 1] == "full"
        self.source_layer = layer_number if is_mtp_layer else topk_source_layers(types)[layer_number - 1] + 1
        # Only publish when a later layer reuses this layer's top-k.
        self.publishes_topk = not is_mtp_layer and self.computes_topk and any(
            src + 1 == layer_number for i, src in enumerate(topk_source_layers(types)) if i != layer_number - 1)
        self.indexer = build_module(submodules.indexer, config=config, pg_collection=pg_collection) \
            if self.computes_topk else None

    def forward(self, query, key, value, attention_mask, x, qr, position_ids=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, up_v_weight=None):
        if value is not None:
            raise ValueError("GLM-5 DSA expects the absorbed MLA layout (value=None)")
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        # Flat layout: [T, H, D] queries, [T, D] keys (see attention/topk.py).
        if packed:
            q_flat, kv_flat = query, key.reshape(key.shape[0], key.shape[-1])
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            lengths = sequence_lengths(cu, q_flat.shape[0] * self.cp)  # one host read per layer; CP: global
        else:
            sq, b = query.shape[:2]
            q_flat = query.transpose(0, 1).reshape(b * sq, *query.shape[2:])
            kv_flat = key.transpose(0, 1).reshape(b * sq, key.shape[-1])
            lengths = (sq,) * b
        rows = None
        if self.cp > 1:  # this rank's tokens of every sequence; keys gathered from every rank
            if not packed:
                raise ValueError("DSA under context parallelism needs the thd packed layout (packed_seq_params)")
            rows = context_parallel.local_rows(lengths, self.cp, self.pg_collection.cp.rank(), query.device)
            kv_flat = context_parallel.gather_sequence(kv_flat, lengths, self.pg_collection.cp)
        starts = flat_starts(lengths, query.device)

        topk = self._topk(x, qr, starts, packed, packed_seq_params, attention_mask, position_ids, rows, lengths)
        if self.token_parallel:  # all heads of this rank's tokens, then back to its heads
            out = token_parallel.attend(self.backend, q_flat, kv_flat, topk, self.softmax_scale, self.v_channels,
                                        packed=packed, group=self.pg_collection.tp, lengths=lengths)
        else:
            out = self.backend(q_flat, kv_flat, topk, self.softmax_scale, self.v_channels,
                               packed=packed)  # [T, H, 512]

        if packed:
            return out.reshape(out.shape[0], -1)
        return out.reshape(b, sq, -1).transpose(0, 1).contiguous()

    def _topk(self, x, qr, starts, packed, packed_seq_params, attention_mask, position_ids, rows=None,
              lengths=None) -> torch.Tensor:
        """[queries, index_topk] flat key indices; under CP, `rows` are this rank's queries (global
        flat indices) and the keys are the gathered sequence's."""
        carrier = (packed_seq_params, attention_mask, position_ids)
        if not self.computes_topk:
            return index_share.reuse(self.layer_number, self.source_layer, *carrier)

        def compute() -> torch.Tensor:
            # The indexer sees detached inputs and trains on no loss of the main model.
            with torch.no_grad():
                q, k, w = self.indexer.forward_before_topk(x.detach(), qr.detach(), packed_seq_params)
                # q [s, b, Hi, D] / k [s, b, D] / w [s, b, Hi] (thd: b = 1) → flat
                q = q.transpose(0, 1).reshape(-1, *q.shape[2:])
                k = k.transpose(0, 1).reshape(-1, k.shape[-1])
                w = w.transpose(0, 1).reshape(-1, w.shape[-1])
                if rows is not None:
                    k = context_parallel.gather_sequence(k, lengths, self.pg_collection.cp)
                    return context_parallel.select_local_topk(self.select_topk, q, k, w, starts, rows, self.index_topk)
                # every TP rank holds the same q/k/w: each scores 1/TP of the rows
                return select_topk_split(self.select_topk, q, k, w, starts, self.index_topk,
                                         self.pg_collection.tp)

        # R3 indexer replay (glm5_bridge/model/replay.py): compute(), or the recorded / replayed top-k
        # (under CP: this rank's query rows of it).
        topk = replay.resolve(self, starts, carrier, compute, rows)
        if self.publishes_topk:
            index_share.publish(self.layer_number, topk, *carrier)
        return topk


def indexer_spec(backend_provider) -> ModuleSpec:
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerSubmodules

    return ModuleSpec(module=DSAIndexer, submodules=DSAIndexerSubmodules(
        linear_wq_b=backend_provider.linear(),
        linear_wk=backend_provider.linear(),
        k_norm=backend_provider.layer_norm(rms_norm=False, for_qk=True),
        linear_weights_proj=backend_provider.linear(),
    ))
