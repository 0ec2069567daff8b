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
`kl_coef`·KL(π_θ ‖ π_ref) (k3 estimator) where the reference is the base model (adapters off),
summed over the response tokens of the whole global batch and divided by their count (the engine's
per-token normalisation, train/engine.py). Every step also reports the train↔rollout mismatch on
the response tokens: mean and max |log p_θ − log p_rollout| and KL(rollout ‖ train) (k3), the
numbers R3 replay exists to shrink. Runs, resumes, checkpoints and exports like SFT (train/sft.py).
"""

from __future__ import annotations

import math
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from glm5_bridge.model.config import load_hf_config
from glm5_bridge.model.payload import ReplayLayout, RequestTopk, decode_routed_experts, from_store
from glm5_bridge.model.replay import IndexerReplay
from glm5_bridge.train.common import adapters_off, token_logprobs, token_nll
from glm5_bridge.train.data import GlobalBatches, greedy_groups, pack, read_jsonl, real_tokens
from glm5_bridge.train.recipe import Recipe
from glm5_bridge.train.routing_replay import replaying_routes
from glm5_bridge.train.run import (check_run_outputs, deterministic_algorithms, run_steps,
                                   warn_topk_beyond_sequences)


class Rollout:
    """One sample of a rollout file, validated."""

    def __init__(self, row: dict, where: str, vocab_size: int, layout: ReplayLayout, store=None):
        for key in ("tokens", "loss_mask", "rollout_logprobs"):
            if key not in row:
                raise ValueError(f"{where}: missing key {key!r}")
        self.tokens = [int(t) for t in _numbers(row, "tokens", where, whole=True)]
        n = len(self.tokens)
        if n < 2:
            raise ValueError(f"{where}: needs at least 2 tokens, has {n}")
        for key in ("loss_mask", "rollout_logprobs"):
            if len(_numbers(row, key, where, whole=key == "loss_mask")) != n:
                raise ValueError(f"{where}: {key} has {len(row[key])} entries, tokens has {n}")
        bad = [t for t in self.tokens if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{where}: token id {bad[0]} is outside the vocabulary (size {vocab_size})")
        self.loss_mask = [int(m) for m in row["loss_mask"]]
        bad = next((i for i, m in enumerate(row["loss_mask"]) if m not in (0, 1)), None)
        if bad is not None:
            raise ValueError(f"{where}: loss_mask[{bad}] is {row['loss_mask'][bad]!r}; it must be 0 or 1")
        self.rollout_logprobs = [float(x) if x is not None else 0.0 for x in row["rollout_logprobs"]]
        bad = next((i for i, (x, m) in enumerate(zip(self.rollout_logprobs, self.loss_mask))
                    if m and not (math.isfinite(x) and x <= 0)), None)
        if bad is not None:  # only trained positions count: a prompt's entries are ignored
            raise ValueError(f"{where}: rollout_logprobs[{bad}] is {self.rollout_logprobs[bad]}; log-probs must be "
                             "finite and ≤ 0")
        self.advantage, self.reward = _number(row, "advantage", where), _number(row, "reward", where)
        if self.advantage is None and self.reward is None:
            raise ValueError(f"{where}: needs 'advantage' or 'reward'")
        self.group = row.get("group", "")
        meta = row.get("meta_info") or {}
        if meta.get("indexer_topk"):
            self.topk = RequestTopk.from_sglang(meta, layout, n, sample_id=where)
        elif store is not None and meta.get("indexer_topk_store"):  # streamed in by load_rollouts
            self.topk = from_store(store, meta["indexer_topk_store"], sample_id=where)
        else:
            self.topk = None
        self.routes = (decode_routed_experts(meta, layout, n, sample_id=where)
                       if meta.get("routed_experts") and layout.moe_topk else None)


def _numbers(row: dict, key: str, where: str, whole: bool) -> list:
    """row[key] as a list of numbers (whole ones where `whole`; None allowed in log-probs: sglang
    has none for the first token), or a one-line error naming the entry."""
    values = row[key]
    if not isinstance(values, list):
        raise ValueError(f"{where}: {key} must be a list of numbers, got {type(values).__name__}")
    for i, x in enumerate(values):
        number = isinstance(x, (int, float)) and not isinstance(x, bool)
        if not (number and (not whole or float(x).is_integer())) and not (x is None and key == "rollout_logprobs"):
            raise ValueError(f"{where}: {key}[{i}] is {x!r}, not {'a whole number' if whole else 'a number'}")
    return values


def _number(row: dict, key: str, where: str) -> float | None:
    value = row.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {key} is {value!r}, not a number")
    if not math.isfinite(value):
        raise ValueError(f"{where}: {key} is {value}; it must be finite")
    return float(value)


def load_rollouts(path, vocab_size: int, layout: ReplayLayout, limit: int = 0, store: Path | None = None
                  ) -> list[Rollout]:
    """The rollouts of a file, checked. With `store` (a file path), the indexer top-k payloads are
    streamed into a compact replay store there (model/replay_ingest.py) and replay reads them a
    layer at a time from it: host memory stays a block of rows, not the payloads."""
    replay_store = None
    if store is not None and Path(path).is_file():
        from glm5_bridge.model.replay_ingest import ingest_rollouts
        from glm5_bridge.model.replay_store import ReplayStore

        Path(store).parent.mkdir(parents=True, exist_ok=True)
        rows = ingest_rollouts(path, store, layout)[: limit or None]
        replay_store = ReplayStore(store)
    else:
        rows = read_jsonl(path)[: limit or None]
    if not rows:
        raise ValueError(f"{path}: no rollouts")
    samples = []
    for i, row in enumerate(rows):
        try:
            samples.append(Rollout(row, f"{path}:{i + 1}", vocab_size, layout, replay_store))
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
    """[T] log-probs of the labels from a plain model chunk; with `replay`, under the rollout's
    indexer top-k and expert routing (whichever the rollouts carry)."""
    with ExitStack() as stack:
        if replay and batch.replay is not None:
            stack.enter_context(IndexerReplay.replaying(batch.replay))
        if replay and getattr(batch, "routes", None) is not None:
            stack.enter_context(replaying_routes(model, batch.routes))
        return token_logprobs(model, batch)


def replay_context(replay: bool, base: bool = False):
    """The engine's per-micro-batch forward context: the rollout's top-k bound to this micro-batch
    (IndexerReplay.attach, which backward recomputes also find) and its experts; `base`: adapters off."""
    @contextmanager
    def context(batch, packed_seq_params, model):
        with ExitStack() as stack:
            if base:
                stack.enter_context(adapters_off(model))
            if replay and batch.replay is not None:
                IndexerReplay.attach(packed_seq_params, batch.replay)
            if replay and batch.routes is not None:  # under CP the batch is this rank's share (token_rows)
                stack.enter_context(replaying_routes(model, batch.routes, getattr(batch, "token_rows", None)))
            yield
    return context


def with_padding_payloads(batch):
    """After engine.fit: payloads that follow its padding. A sequence padded at its end (context
    parallel's `sequence_pads`) gets, per pad, the window of the most recent keys as top-k and −1
    experts (the router chooses); the padding segment, if any, gets payloads that ask for nothing (all
    −1: the layer's indexer and the router choose). Pads never enter the loss: these only make every
    packed segment's payload as long as the segment."""
    pads = getattr(batch, "sequence_pads", None)
    if pads:
        if batch.replay is not None:
            batch.replay = [req.with_window_rows(e) if e else req for req, e in zip(batch.replay, pads)]
        if batch.routes is not None:
            batch.routes = [torch.cat([r, torch.full((e, *r.shape[1:]), -1, dtype=r.dtype)]) if e else r
                            for r, e in zip(batch.routes, pads)]
    extra = getattr(batch, "padding_segment", 0)
    if not extra:
        return batch
    if batch.replay is not None:
        first = batch.replay[0]
        batch.replay = [*batch.replay, RequestTopk(torch.full((extra, first.num_layers, first.index_topk), -1,
                                                              dtype=torch.int32))]
    if batch.routes is not None:  # len − 1 rows, as a sample's: replaying_routes adds the last one
        first = batch.routes[0]
        batch.routes = [*batch.routes, torch.full((extra - 1, *first.shape[1:]), -1, dtype=torch.int32)]
    return batch


RL_METRICS = ["pg_sum", "kl_ref_sum", "absdiff_sum", "absdiff_max", "kl_rt_sum", "ratio_sum", "resp_tokens", "tokens"]


def rl_loss_fn(clip_eps: float, kl_coef: float):
    """Per micro-batch: (summed per-token loss over its response tokens, their count, sums)."""
    def loss_fn(output, batch):
        mask = batch.loss_mask[0]
        logprobs = -token_nll(output, batch.labels)
        log_ratio = logprobs - batch.rollout_logprobs[0]
        ratio = torch.exp(log_ratio)
        adv = batch.advantages[0]
        pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
        loss = (pg * mask).sum()
        kl_ref = torch.zeros((), device=loss.device)
        if kl_coef and getattr(batch, "ref_logprobs", None) is not None:
            d = batch.ref_logprobs - logprobs
            kl_ref = ((torch.exp(d) - d - 1) * mask).sum()
            loss = loss + kl_coef * kl_ref
        with torch.no_grad():
            lr_d = log_ratio.detach()
            diff = lr_d.abs() * mask
            real = real_tokens(batch).to(loss.device)
            metrics = {"pg_sum": (pg.detach() * mask).sum(), "kl_ref_sum": kl_ref.detach(), "absdiff_sum": diff.sum(),
                       "absdiff_max": diff.max(), "kl_rt_sum": ((torch.exp(lr_d) - lr_d - 1) * mask).sum(),
                       "ratio_sum": (ratio.detach() * mask).sum(), "resp_tokens": mask.sum(), "tokens": real}
        return loss, mask.sum().to(torch.int), metrics
    return loss_fn


def reference_logprobs(engine, micro_batches: list, replay: bool) -> None:
    """The base model's (adapters off) log-probs of every micro-batch, kept on the batch for the KL
    term (on the last pipeline stage, where the loss is computed)."""
    def collect(output, batch):
        lp = -token_nll(output, batch.labels)
        return lp.sum(), torch.zeros((), dtype=torch.int, device=lp.device), {"logprobs": lp}

    _, per_batch = engine.forward_only(micro_batches, collect, [], context=replay_context(replay, base=True))
    for batch, d in zip(micro_batches, per_batch):
        batch.ref_logprobs = d["logprobs"].detach()


def rl_record(m: dict, step: int, seconds: float, replayed: bool, routed: bool) -> dict:
    n = max(m["resp_tokens"], 1.0)
    return {"step": step, "loss": (m["pg_sum"] + m.get("kl_coef", 0.0) * m["kl_ref_sum"]) / n,
            "pg_loss": m["pg_sum"] / n, "kl_to_reference": m["kl_ref_sum"] / n, "grad_norm": m["grad_norm"],
            "lr": m["lr"], "logprob_abs_diff_mean": m["absdiff_sum"] / n, "logprob_abs_diff_max": m["absdiff_max"],
            "kl_rollout_train": m["kl_rt_sum"] / n, "ratio_mean": m["ratio_sum"] / n, "replay": replayed,
            "routing_replay": routed, "tokens": int(m["tokens"]), "tokens_per_s": m["tokens"] / seconds}


def rl_step(engine, micro_batches: list, recipe: Recipe, step: int) -> dict:
    """One optimizer step over this rank's rollout micro-batches (already fitted to the layout)."""
    rl = recipe.rl
    micro_batches = [with_padding_payloads(b) for b in micro_batches]
    replayed = bool(rl.replay and micro_batches and micro_batches[0].replay is not None)
    routed = bool(rl.replay and micro_batches and micro_batches[0].routes is not None)
    t0 = time.perf_counter()
    if rl.kl_coef:
        reference_logprobs(engine, micro_batches, rl.replay)
    m = engine.step(micro_batches, rl_loss_fn(rl.clip_eps, rl.kl_coef), RL_METRICS, context=replay_context(rl.replay))
    m["kl_coef"] = rl.kl_coef
    return rl_record(m, step, time.perf_counter() - t0, replayed, routed)


def train_rl(recipe: Recipe, stop_after: int | None = None) -> dict:
    """RL on a rollout file (recipe.data.train): global batches of packed rollout micro-batches (whole
    samples up to data.max_tokens, file order, cycled), checkpoints, resume and export like SFT."""
    with deterministic_algorithms(recipe.train.deterministic):
        return _train_rl(recipe, stop_after)


def _train_rl(recipe: Recipe, stop_after: int | None) -> dict:
    from glm5_bridge.model.validate import validate_checkpoint
    from glm5_bridge.train.engine import Engine, data_parallel_info
    from glm5_bridge.train.plan import check_recipe_fits

    # Inputs first (cheap, one-line errors), then the layout against the GPU, then the model.
    validate_checkpoint(recipe.model.checkpoint)
    check_run_outputs(recipe)
    hf = load_hf_config(recipe.model.checkpoint)
    t = recipe.train
    store = None
    if recipe.rl.replay_store:  # one store per rank: ranks read the same file, none waits for another
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        store = Path(t.output_dir) / "replay" / f"{Path(recipe.data.train).name}.rank{rank}.r3"
    samples = load_rollouts(recipe.data.train, hf.vocab_size, ReplayLayout.from_hf_config(hf), recipe.data.limit,
                            store)
    warn_topk_beyond_sequences(hf, max(len(s.tokens) for s in samples), "rollout")
    if not recipe.rl.replay_routes:  # the indexer top-k alone is replayed; routers choose afresh
        for s in samples:
            s.routes = None
    groups = _micro_batches(samples, recipe.data.max_tokens)
    routes = recipe.rl.replay and all(s.routes is not None for s in samples)
    check_recipe_fits(recipe, hf)
    engine = Engine(recipe, **({"moe_enable_routing_replay": True} if routes else {}))
    dp_rank, dp_size = data_parallel_info()
    stream = GlobalBatches(lambda e: [rollout_batch(g, hf.vocab_size) for g in groups], t.global_batch_size)
    stream.step(0, dp_rank, dp_size)

    return run_steps(recipe, engine, "rl",
                     lambda step: rl_step(engine, engine.fit_all(stream.step(step, dp_rank, dp_size)),
                                          recipe, step + 1),
                     ["loss", "logprob_abs_diff_mean", "kl_rollout_train"], "rl.png", stop_after)


def _micro_batches(samples: list[Rollout], max_tokens: int) -> list[list[Rollout]]:
    groups = greedy_groups([len(s.tokens) for s in samples], max_tokens, what="rollout")
    return [[samples[i] for i in group] for group in groups]
