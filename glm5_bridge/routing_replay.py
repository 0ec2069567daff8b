"""MoE routing replay for RL: train with exactly the experts the rollout engine routed each token to.

sglang returns `meta_info.routed_experts`: base64 of int32 little-endian, shape
(len(tokens) − 1, num_layers, moe_topk). `num_layers` may count every decoder layer (the
first_k_dense_replace dense layers then carry unused rows) or only the MoE layers; both are
accepted. The MTP layer is never in the payload and routes by itself.

megatron-core has the mechanism (`RouterReplay`, enabled by `moe_enable_routing_replay`): each
router takes the given indices and gathers its own scores at them, so gradients still flow through
the router probabilities. This module turns payloads into the per-layer [T, topk] tensors of one
packed micro-batch and sets them on this model's decoder routers only.
"""

from __future__ import annotations

import base64
from contextlib import contextmanager

import torch
from megatron.core.transformer.moe.router_replay import RouterReplayAction


def decode_routed_experts(meta_info: dict, num_tokens: int, moe_topk: int, where: str = "") -> torch.Tensor:
    """int32 [num_tokens − 1, num_layers, moe_topk] from sglang's meta_info."""
    raw = base64.b64decode(meta_info["routed_experts"])
    rows = num_tokens - 1
    if len(raw) % (4 * rows * moe_topk):
        raise ValueError(f"{where}: routed_experts has {len(raw)} bytes, not a multiple of "
                         f"(len(tokens) − 1 = {rows}) × moe_topk {moe_topk} × 4")
    layers = len(raw) // (4 * rows * moe_topk)
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).view(rows, layers, moe_topk).clone()


def encode_routed_experts(experts: torch.Tensor) -> str:
    return base64.b64encode(experts.to(torch.int32).contiguous().numpy().astype("<i4").tobytes()).decode("ascii")


def decoder_routers(model) -> list:
    """(name, RouterReplay) of the decoder's MoE routers in layer order (MTP excluded)."""
    routers = [(name, m.router_replay) for name, m in model.named_modules()
               if getattr(m, "router_replay", None) is not None and not name.startswith("mtp.")]
    if not routers:
        raise ValueError("the model was built without moe_enable_routing_replay=True")
    return routers


@contextmanager
def replaying_routes(model, per_sample: list[torch.Tensor], num_experts: int, first_k_dense: int):
    """Route every decoder MoE layer by the given experts for the forward(s) inside the block.

    per_sample[i]: int32 [len_i − 1 (or len_i), layers, topk] for the i-th packed sample; the
    sample's last position (no rollout row) routes to experts 0..topk−1: it predicts past the end
    of the sample, so it never reaches the loss.
    """
    routers = decoder_routers(model)
    n_moe = len(routers)
    per_layer = [[] for _ in range(n_moe)]
    for i, experts in enumerate(per_sample):
        layers, topk = experts.shape[1], experts.shape[2]
        if layers == n_moe + first_k_dense:
            experts = experts[:, first_k_dense:]
        elif layers != n_moe:
            raise ValueError(f"sample {i}: routed_experts has {layers} layers; the model has {n_moe} MoE layers "
                             f"({n_moe + first_k_dense} decoder layers)")
        if experts.numel() and (int(experts.min()) < 0 or int(experts.max()) >= num_experts):
            raise ValueError(f"sample {i}: routed_experts holds expert ids outside [0, {num_experts})")
        last = torch.arange(topk, dtype=torch.int32).expand(1, n_moe, topk)
        experts = torch.cat([experts, last])
        for j in range(n_moe):
            per_layer[j].append(experts[:, j])
    try:
        for (_, replay), idx in zip(routers, per_layer):
            replay.clear_indices()
            replay.set_target_indices(torch.cat(idx).long())
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        yield
    finally:
        for _, replay in routers:
            replay.clear_router_replay_action()
            replay.clear_indices()


@contextmanager
def recording_routes(model):
    """Record the decoder routers' choices; yields a list filled, on exit, with one int32
    [T, moe_layers, topk] tensor (the packed micro-batch's routing)."""
    routers = decoder_routers(model)
    out: list[torch.Tensor] = []
    for _, replay in routers:
        replay.clear_indices()
        replay.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield out
        out.append(torch.stack([replay.get_recorded_indices().to(torch.int32).cpu() for _, replay in routers], 1))
    finally:
        for _, replay in routers:
            replay.clear_router_replay_action()
            replay.clear_indices()
