"""LoRA RL: a GRPO-style policy-gradient step on rollouts, with R3 indexer replay.

Rollout jsonl, one sample per line:
    tokens            prompt + response token ids
    loss_mask         1 for response tokens (trained), 0 for the prompt; len(tokens)
    rollout_logprobs  log p_rollout(tokens[t] | tokens[:t]) per position (prompt entries ignored)
    advantage         per sample; or `reward` (+ optional `group`): advantages are then the rewards
                      normalised within each group (GRPO), all samples being one group by default
    meta_info         optional sglang meta_info with `indexer_topk` (+ `indexer_topk_num_layers`) and/or
                      `routed_experts` (+ `routed_experts_start_len`), decoded and checked by
                      glm5_bridge/model/payload.py; replayed in training when `rl.replay` is on
                      (glm5_bridge/model/replay.py, glm5_bridge/train/routing_replay.py)

Loss per response token: −min(ρ·A, clip(ρ, 1−ε, 1+ε)·A), ρ = exp(log p_θ − log p_rollout), plus
`kl_coef`·KL(π_θ ‖ π_ref) (k3 estimator) where the reference is the base model (adapters off).
Every step also reports the train↔rollout mismatch on the response tokens: mean and max
|log p_θ − log p_rollout| and KL(rollout ‖ train) (k3), the numbers R3 replay exists to shrink.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from glm5_bridge.model.config import load_hf_config
from glm5_bridge.files import atomic_write_text
from glm5_bridge.train.data import greedy_groups, pack, read_jsonl
from glm5_bridge.model.payload import ReplayLayout, RequestTopk, decode_routed_experts
from glm5_bridge.model.replay import IndexerReplay
from glm5_bridge.train.routing_replay import replaying_routes
from glm5_bridge.train import checkpoint
from glm5_bridge.train.common import adapters_off, build_policy, masked_mean, optimizer_and_schedule, plot_curves, token_logprobs
from glm5_bridge.train.recipe import Recipe
from glm5_bridge.model.validate import validate_checkpoint


class Rollout:
    """One sample of a rollout file, validated."""

    def __init__(self, row: dict, where: str, vocab_size: int, layout: ReplayLayout):
        for key in ("tokens", "loss_mask", "rollout_logprobs"):
            if key not in row:
                raise ValueError(f"{where}: missing key {key!r}")
        self.tokens = [int(t) for t in row["tokens"]]
        n = len(self.tokens)
        if n < 2:
            raise ValueError(f"{where}: needs at least 2 tokens, has {n}")
        for key in ("loss_mask", "rollout_logprobs"):
            if len(row[key]) != n:
                raise ValueError(f"{where}: {key} has {len(row[key])} entries, tokens has {n}")
        bad = [t for t in self.tokens if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{where}: token id {bad[0]} is outside the vocabulary (size {vocab_size})")
        self.loss_mask = [int(m) for m in row["loss_mask"]]
        self.rollout_logprobs = [float(x) if x is not None else 0.0 for x in row["rollout_logprobs"]]
        self.advantage = row.get("advantage")
        self.reward = row.get("reward")
        if self.advantage is None and self.reward is None:
            raise ValueError(f"{where}: needs 'advantage' or 'reward'")
        self.group = row.get("group", "")
        meta = row.get("meta_info") or {}
        self.topk = (RequestTopk.from_sglang(meta, layout, n, sample_id=where)
                     if meta.get("indexer_topk") else None)
        self.routes = (decode_routed_experts(meta, layout, n, sample_id=where)
                       if meta.get("routed_experts") and layout.moe_topk else None)


def load_rollouts(path, vocab_size: int, layout: ReplayLayout, limit: int = 0) -> list[Rollout]:
    rows = read_jsonl(path)[: limit or None]
    if not rows:
        raise ValueError(f"{path}: no rollouts")
    samples = []
    for i, row in enumerate(rows):
        try:
            samples.append(Rollout(row, f"{path}:{i + 1}", vocab_size, layout))
        except (TypeError, KeyError, AttributeError) as e:  # a value of the wrong kind
            raise ValueError(f"{path}:{i + 1}: malformed rollout ({type(e).__name__}: {e})") from None
    _fill_advantages(samples)
    return samples


def _fill_advantages(samples: list[Rollout]) -> None:
    """GRPO: reward minus its group's mean, over the group's std (1 when the group is constant)."""
    groups: dict[str, list[Rollout]] = {}
    for s in samples:
        if s.advantage is None:
            groups.setdefault(s.group, []).append(s)
    for members in groups.values():
        rewards = torch.tensor([float(s.reward) for s in members])
        std = rewards.std(unbiased=False).item() if len(members) > 1 else 0.0
        for s, r in zip(members, rewards.tolist()):
            s.advantage = (r - rewards.mean().item()) / (std if std > 1e-6 else 1.0)


def rollout_batch(samples: list[Rollout], vocab_size: int):
    """Pack samples into one thd micro-batch; per-position rollout logprobs and advantages aligned
    with the labels (position t predicts token t+1)."""
    batch = pack([(s.tokens, s.loss_mask) for s in samples], vocab_size)
    old, adv = [], []
    for s in samples:
        old += s.rollout_logprobs[1:] + [0.0]
        adv += [float(s.advantage)] * len(s.tokens)
    batch.rollout_logprobs = torch.tensor(old).unsqueeze(0)
    batch.advantages = torch.tensor(adv).unsqueeze(0)
    batch.replay = [s.topk for s in samples] if all(s.topk is not None for s in samples) else None
    batch.routes = [s.routes for s in samples] if all(s.routes is not None for s in samples) else None
    return batch


def policy_logprobs(model, batch, replay: bool) -> torch.Tensor:
    """[T] log-probs of the labels; with `replay`, under the rollout's indexer top-k and expert
    routing (whichever the rollouts carry)."""
    with ExitStack() as stack:
        if replay and batch.replay is not None:
            stack.enter_context(IndexerReplay.replaying(batch.replay))
        if replay and getattr(batch, "routes", None) is not None:
            stack.enter_context(replaying_routes(model, batch.routes))
        return token_logprobs(model, batch)


def rl_loss(logprobs, batch, clip_eps: float, kl_coef: float, ref_logprobs=None):
    """(loss, metrics) for one micro-batch; all averages over response tokens."""
    mask = batch.loss_mask[0]
    old = batch.rollout_logprobs[0]
    adv = batch.advantages[0]
    log_ratio = logprobs - old
    ratio = torch.exp(log_ratio)
    pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    loss = masked_mean(pg, mask)
    metrics = {}
    if kl_coef and ref_logprobs is not None:
        d = ref_logprobs - logprobs
        kl_ref = masked_mean(torch.exp(d) - d - 1, mask)
        loss = loss + kl_coef * kl_ref
        metrics["kl_to_reference"] = kl_ref.item()
    with torch.no_grad():
        diff = log_ratio.detach().abs() * mask
        lr_d = log_ratio.detach()
        metrics.update({
            "logprob_abs_diff_mean": (diff.sum() / mask.sum().clamp_min(1)).item(),
            "logprob_abs_diff_max": diff.max().item(),
            # KL(rollout ‖ train), k3 estimator on rollout samples.
            "kl_rollout_train": masked_mean(torch.exp(lr_d) - lr_d - 1, mask).item(),
            "ratio_mean": masked_mean(ratio.detach(), mask).item(),
        })
    return loss, metrics


def rl_step(model, params, optimizer, scheduler, batch, recipe: Recipe) -> dict:
    """One optimizer step on one rollout micro-batch."""
    rl = recipe.rl
    ref = None
    if rl.kl_coef:
        with torch.no_grad(), adapters_off(model):
            ref = policy_logprobs(model, batch, rl.replay)
    logprobs = policy_logprobs(model, batch, rl.replay)
    loss, metrics = rl_loss(logprobs, batch, rl.clip_eps, rl.kl_coef, ref)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(list(params.values()), recipe.train.grad_clip)
    optimizer.step()
    scheduler.step()
    metrics.update(loss=loss.item(), grad_norm=float(grad_norm), replay=bool(rl.replay and batch.replay is not None),
                   routing_replay=bool(rl.replay and getattr(batch, "routes", None) is not None))
    return metrics


def train_rl(recipe: Recipe) -> dict:
    """RL on a rollout file (recipe.data.train): micro-batches of whole samples up to
    data.max_tokens, one optimizer step each, cycling through the file."""
    # Inputs first (cheap, one-line errors), then the model, then the output folder.
    validate_checkpoint(recipe.model.checkpoint)
    hf = load_hf_config(recipe.model.checkpoint)
    samples = load_rollouts(recipe.data.train, hf.vocab_size, ReplayLayout.from_hf_config(hf), recipe.data.limit)
    groups = _micro_batches(samples, recipe.data.max_tokens)
    routes = recipe.rl.replay and all(s.routes is not None for s in samples)
    bridge, model, params = build_policy(recipe, **({"moe_enable_routing_replay": True} if routes else {}))
    optimizer, scheduler = optimizer_and_schedule(params, recipe)
    out = Path(recipe.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.train()
    history = []
    for step in range(recipe.train.steps):
        batch = rollout_batch(groups[step % len(groups)], model.vocab_size)
        t0 = time.perf_counter()
        metrics = rl_step(model, params, optimizer, scheduler, batch, recipe)
        metrics.update(step=step + 1, tokens_per_s=batch.num_tokens / (time.perf_counter() - t0))
        history.append(metrics)
        print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}))
        if recipe.train.save_every and (step + 1) % recipe.train.save_every == 0:
            checkpoint.save(out / "checkpoints", step + 1, params, optimizer, scheduler, history)
    atomic_write_text(out / "history.json", json.dumps(history, indent=1))
    plot_curves(history, ["loss", "logprob_abs_diff_mean", "kl_rollout_train"], out / "rl.png", "LoRA RL")
    return {"history": history, "model": model, "bridge": bridge}


def _micro_batches(samples: list[Rollout], max_tokens: int) -> list[list[Rollout]]:
    groups = greedy_groups([len(s.tokens) for s in samples], max_tokens, what="rollout")
    return [[samples[i] for i in group] for group in groups]

