"""MoE routing replay for RL: train with exactly the experts the rollout engine routed each token to.

megatron-core has the mechanism (`RouterReplay`, enabled by `moe_enable_routing_replay`): each
router takes the given indices and gathers its own scores at them, so gradients still flow through
the router probabilities. This module sets per-layer [T, topk] targets for one packed micro-batch on
this model's decoder routers only (the MTP layer is never in a payload and routes by itself).
Payloads are decoded by glm5_bridge/model/payload.py (`decode_routed_experts`): MoE layers only, −1 rows
where the engine sent none (before `routed_experts_start_len`). Such rows, and each sample's last
position (no rollout row), take the router's own choice.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction


class _ReplayWithGaps(RouterReplay):
    """Replays the target experts; rows whose target is −1 take the router's own top-k."""

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        target = self.target_topk_idx.to(scores.device)
        gaps = target[:, 0] < 0
        if bool(gaps.any()):
            _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            target = torch.where(gaps[:, None], own, target)
        return scores.gather(1, target), target


def decoder_routers(model) -> list:
    """The decoder's MoE router modules of this model chunk (this pipeline stage's), in layer order
    (MTP excluded); each knows its global layer number."""
    routers = [m for name, m in model.named_modules()
               if getattr(m, "router_replay", None) is not None and ".mtp." not in f".{name}"]
    if not routers and any(hasattr(m, "router") for m in model.modules()):
        raise ValueError("the model was built without moe_enable_routing_replay=True")
    return routers


def _router_tokens(targets: torch.Tensor, rows: torch.Tensor | None, config) -> torch.Tensor:
    """The rows of the micro-batch's [T, topk] targets this rank's routers see, in their order: its
    context-parallel share `rows` (global flat indices), then, under sequence parallelism, its
    tensor-parallel rank's contiguous 1/TP of those."""
    if rows is not None:
        targets = targets[rows.to(targets.device)]
    if getattr(config, "sequence_parallel", False):
        from megatron.core import parallel_state

        tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
        targets = targets.chunk(tp)[rank]
    return targets


@contextmanager
def replaying_routes(model, per_sample: list[torch.Tensor], rows: torch.Tensor | None = None):
    """Route every decoder MoE layer of this chunk by the given experts for the forward(s) inside
    the block.

    per_sample[i]: int32 [len_i − 1 (or len_i), MoE layers of the whole model, topk] for the i-th
    packed sample, −1 rows routed by the router itself. `rows`: under context parallelism, the global
    flat rows of this rank's tokens (the model sees those, in that order).
    """
    routers = decoder_routers(model)
    first_moe = model.config.moe_layer_freq.index(1) if isinstance(model.config.moe_layer_freq, list) else 0
    slots = [router.layer_number - 1 - first_moe for router in routers]  # payload slot of each router
    per_layer = [[] for _ in routers]
    for i, experts in enumerate(per_sample):
        if slots and experts.shape[1] <= max(slots):
            raise ValueError(f"sample {i}: routed experts for {experts.shape[1]} MoE layers; the model has more")
        last = torch.full((1, experts.shape[1], experts.shape[2]), -1, dtype=torch.int32)
        experts = torch.cat([experts, last])
        for j, slot in enumerate(slots):
            per_layer[j].append(experts[:, slot])
    upstream = [router.router_replay for router in routers]
    try:
        for router, targets in zip(routers, per_layer):
            replay = _ReplayWithGaps()
            RouterReplay.global_router_replay_instances.remove(replay)  # ours is scoped to this block
            mine = _router_tokens(torch.cat(targets), rows, model.config)
            replay.set_target_indices(mine.long().to(router.weight.device))
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            router.router_replay = replay
        yield
    finally:
        for router, replay in zip(routers, upstream):
            router.router_replay = replay


@contextmanager
def recording_routes(model):
    """Record the decoder routers' choices; yields a list filled, on exit, with one int32
    [T, moe_layers, topk] tensor (the packed micro-batch's routing)."""
    replays = [router.router_replay for router in decoder_routers(model)]
    out: list[torch.Tensor] = []
    for replay in replays:
        replay.clear_indices()
        replay.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield out
        out.append(torch.stack([replay.get_recorded_indices().to(torch.int32).cpu() for replay in replays], 1))
    finally:
        for replay in replays:
            replay.clear_router_replay_action()
            replay.clear_indices()
