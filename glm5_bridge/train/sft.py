"""LoRA SFT: chat jsonl → packed thd micro-batches → masked next-token loss → AdamW on the adapters,
with atomic checkpoints, exact resume, a progress bar, a loss-curve PNG and an HF export at the end.

The data order is a function of (data.seed, epoch) only and the step index picks the micro-batch,
so a resumed run sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from glm5_bridge.model.config import load_hf_config
from glm5_bridge.files import atomic_write_text
from glm5_bridge.train.data import packed_batches, read_jsonl, tokenize_chat
from glm5_bridge.train import checkpoint
from glm5_bridge.train.common import build_policy, masked_mean, optimizer_and_schedule, plot_curves, token_logprobs
from glm5_bridge.train.recipe import Recipe
from glm5_bridge.model.validate import validate_checkpoint


class BatchSchedule:
    """Micro-batch for a global step: epochs of shuffled, packed samples, cycled."""

    def __init__(self, tokenized, max_tokens: int, vocab_size: int, seed: int):
        self.tokenized, self.max_tokens, self.vocab_size, self.seed = tokenized, max_tokens, vocab_size, seed
        self._epochs: dict[int, list] = {}

    def __getitem__(self, step: int):
        epoch0 = self._epoch(0)
        epoch, index = divmod(step, len(epoch0))
        return self._epoch(epoch)[index % len(self._epoch(epoch))]

    def _epoch(self, epoch: int):
        if epoch not in self._epochs:
            self._epochs = {epoch: packed_batches(self.tokenized, self.max_tokens, self.vocab_size, self.seed, epoch)}
        return self._epochs[epoch]


def load_sft_data(recipe: Recipe, tokenizer, vocab_size: int) -> BatchSchedule:
    """Every sample tokenized and checked (assistant turn present, ids inside the vocabulary, length
    within data.max_tokens) before training starts; errors name the file and line."""
    rows = read_jsonl(recipe.data.train)
    if recipe.data.limit:
        rows = rows[: recipe.data.limit]
    if not rows:
        raise ValueError(f"{recipe.data.train}: no samples")
    tokenized = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or "messages" not in row:
            raise ValueError(f"{recipe.data.train}: line {i + 1} has no 'messages' key")
        try:
            ids, mask = tokenize_chat(tokenizer, row["messages"])
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"{recipe.data.train}: line {i + 1}: {e}") from None
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{recipe.data.train}: line {i + 1}: token id {bad[0]} is outside the vocabulary "
                             f"(size {vocab_size}; does the tokenizer belong to the checkpoint?)")
        if len(ids) > recipe.data.max_tokens:
            raise ValueError(f"{recipe.data.train}: line {i + 1} has {len(ids)} tokens, more than "
                             f"data.max_tokens={recipe.data.max_tokens}")
        tokenized.append((ids, mask))
    return BatchSchedule(tokenized, recipe.data.max_tokens, vocab_size, recipe.data.seed)


def train_sft(recipe: Recipe, stop_after: int | None = None) -> dict:
    """Run (or resume) the recipe. `stop_after` ends the run early after that many steps of this
    call (used to test resume); the returned dict has the loss history and the export path."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(recipe.train.deterministic)
    try:
        return _train_sft(recipe, stop_after)
    finally:
        torch.use_deterministic_algorithms(previous)


def _train_sft(recipe: Recipe, stop_after: int | None) -> dict:
    from transformers import AutoTokenizer

    # Inputs first (cheap, one-line errors), then the model, then the output folder.
    validate_checkpoint(recipe.model.checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(recipe.model.checkpoint)
    batches = load_sft_data(recipe, tokenizer, load_hf_config(recipe.model.checkpoint).vocab_size)
    bridge, model, params = build_policy(recipe)
    optimizer, scheduler = optimizer_and_schedule(params, recipe)
    out = Path(recipe.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    start, history = 0, []
    checkpoint.remove_abandoned(out / "checkpoints")  # half-written saves of a killed run
    saved = checkpoint.load_latest(out / "checkpoints") if recipe.train.resume else None
    if saved is not None:
        start = checkpoint.restore(saved[0], params, optimizer, scheduler)
        history = saved[1]
    else:
        torch.manual_seed(recipe.train.seed)

    model.train()
    end = recipe.train.steps if stop_after is None else min(recipe.train.steps, start + stop_after)
    bar = tqdm(range(start, end), initial=start, total=recipe.train.steps, desc="sft", dynamic_ncols=True)
    for step in bar:
        batch = batches[step]
        t0 = time.perf_counter()
        loss = -masked_mean(token_logprobs(model, batch), batch.loss_mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(list(params.values()), recipe.train.grad_clip)
        optimizer.step()
        scheduler.step()
        seconds = time.perf_counter() - t0
        record = {"step": step + 1, "loss": loss.item(), "grad_norm": float(grad_norm),
                  "lr": scheduler.get_last_lr()[0], "tokens": batch.num_tokens,
                  "tokens_per_s": batch.num_tokens / seconds}
        history.append(record)
        bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
        every = recipe.train.save_every
        if (every and (step + 1) % every == 0) or step + 1 == recipe.train.steps:
            checkpoint.save(out / "checkpoints", step + 1, params, optimizer, scheduler, history)
    bar.close()

    result = {"history": history, "output_dir": str(out)}
    atomic_write_text(out / "history.json", json.dumps(history, indent=1))
    if history:
        result["loss_curve"] = str(plot_curves(history, ["loss"], out / "loss.png", "LoRA SFT"))
    if end == recipe.train.steps and recipe.export.kind != "none":
        result["export"] = str(export_trained(recipe, bridge, model))
    result["model"] = model
    return result


def export_trained(recipe: Recipe, bridge, model) -> Path:
    from glm5_bridge.train.export import export_adapter, export_merged

    target = Path(recipe.export.dir or Path(recipe.train.output_dir) / f"export_{recipe.export.kind}")
    write = export_merged if recipe.export.kind == "merged" else export_adapter
    return write(bridge, model, target, overwrite=True)
