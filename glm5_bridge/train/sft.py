"""LoRA SFT on the engine (train/engine.py): chat jsonl → packed thd micro-batches → global batches
→ masked next-token loss, per token over the whole global batch → megatron's Adam on the adapters;
distributed checkpoints with exact resume, validation loss, TensorBoard, a loss curve and an HF
export at the end.

    glm5-bridge train recipes/tiny_lora_sft.yaml                                   # one process
    torchrun --nproc-per-node 2 -m glm5_bridge train recipes/tiny_lora_sft.yaml train.global_batch_size=4

The micro-batch stream is a function of data.seed alone and step s reads global batch s
(data.GlobalBatches), so a resumed run — at the same or another layout — sees exactly the batches
the uninterrupted run would have seen.
"""

from __future__ import annotations

import time

import torch

from glm5_bridge.model.config import load_hf_config
from glm5_bridge.train.common import token_nll
from glm5_bridge.train.data import GlobalBatches, load_tokenizer, packed_batches, read_jsonl, real_tokens, tokenize_chat
from glm5_bridge.train.recipe import Recipe
from glm5_bridge.train.run import (check_run_outputs, deterministic_algorithms, run_steps,
                                   warn_topk_beyond_sequences)

METRICS = ["nll_sum", "loss_tokens", "tokens"]


def load_chat(path, recipe: Recipe, tokenizer, vocab_size: int, limit: int = 0) -> list[tuple[list[int], list[int]]]:
    """Every sample tokenized and checked (assistant turn present, ids inside the vocabulary, length
    within data.max_tokens) before training starts; errors name the file and line."""
    rows = read_jsonl(path)
    if limit:
        rows = rows[:limit]
    if not rows:
        raise ValueError(f"{path}: no samples")
    tokenized, most_chars = [], recipe.data.max_tokens * _longest_token(tokenizer)
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or "messages" not in row:
            raise ValueError(f"{path}: line {i + 1} has no 'messages' key")
        chars = _characters(row["messages"])
        if chars > most_chars:  # refused before tokenizing it (a 10 MB line takes minutes)
            raise ValueError(f"{path}: line {i + 1} has {chars} characters, more than data.max_tokens="
                             f"{recipe.data.max_tokens} tokens can hold (at most {most_chars // recipe.data.max_tokens}"
                             " characters a token, the tokenizer's longest)")
        try:
            ids, mask = tokenize_chat(tokenizer, row["messages"])
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"{path}: line {i + 1}: {e}") from None
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{path}: line {i + 1}: token id {bad[0]} is outside the vocabulary "
                             f"(size {vocab_size}; does the tokenizer belong to the checkpoint?)")
        if len(ids) > recipe.data.max_tokens:
            raise ValueError(f"{path}: line {i + 1} has {len(ids)} tokens, more than "
                             f"data.max_tokens={recipe.data.max_tokens}")
        tokenized.append((ids, mask))
    return tokenized


def _longest_token(tokenizer) -> int:
    """Characters of the longest vocabulary entry (added tokens included): no token covers more
    text, so a text longer than max_tokens × this cannot fit."""
    return max(map(len, tokenizer.get_vocab()))


def _characters(messages) -> int:
    if not isinstance(messages, list):
        return 0  # tokenize_chat names what is wrong with it
    return sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))


def sft_loss(output, batch):
    """(summed masked NLL, loss-token count, metrics) of one micro-batch: the engine divides the
    global batch's gradients by its total count (per-token normalisation)."""
    mask = batch.loss_mask[0]
    nll = (token_nll(output, batch.labels) * mask).sum()
    count = mask.sum()
    real = real_tokens(batch).to(nll.device)
    return nll, count.to(torch.int), {"nll_sum": nll.detach(), "loss_tokens": count.detach(), "tokens": real}


def train_sft(recipe: Recipe, stop_after: int | None = None) -> dict:
    """Run (or resume) the recipe. `stop_after` ends the run early after that many steps of this
    call (used to test resume); the returned dict has the history and the export path."""
    with deterministic_algorithms(recipe.train.deterministic):
        return _train_sft(recipe, stop_after)


def _train_sft(recipe: Recipe, stop_after: int | None) -> dict:
    from glm5_bridge.model.validate import validate_checkpoint
    from glm5_bridge.train.engine import Engine, data_parallel_info
    from glm5_bridge.train.flops import step_rate
    from glm5_bridge.train.plan import check_recipe_fits

    # Inputs first (cheap, one-line errors), then the layout against the GPU, then the model.
    validate_checkpoint(recipe.model.checkpoint)
    check_run_outputs(recipe)
    hf = load_hf_config(recipe.model.checkpoint)
    tokenizer = load_tokenizer(recipe.model.checkpoint)
    data, t = recipe.data, recipe.train
    samples = load_chat(data.train, recipe, tokenizer, hf.vocab_size, data.limit)
    valid = load_chat(data.valid, recipe, tokenizer, hf.vocab_size) if data.valid else []
    warn_topk_beyond_sequences(hf, max(len(ids) for ids, _ in samples + valid), "sample")
    if t.eval_every and not valid:
        raise ValueError("train.eval_every is set but data.valid names no validation file")
    check_recipe_fits(recipe, hf)
    engine = Engine(recipe)
    dp_rank, dp_size = data_parallel_info()
    stream = GlobalBatches(lambda e: packed_batches(samples, data.max_tokens, hf.vocab_size, data.seed, e),
                           t.global_batch_size)
    stream.step(0, dp_rank, dp_size)  # global_batch_size vs DP, before the first step
    valid_batches = packed_batches(valid, data.max_tokens, hf.vocab_size, data.seed, 0)[dp_rank::dp_size] if valid else []

    def one_step(step: int) -> dict:
        micro_batches = engine.fit_all(stream.step(step, dp_rank, dp_size))
        t0 = time.perf_counter()
        m = engine.step(micro_batches, sft_loss, METRICS)
        seconds = time.perf_counter() - t0
        record = {"step": step + 1, "loss": m["nll_sum"] / max(m["loss_tokens"], 1.0), "grad_norm": m["grad_norm"],
                  "lr": m["lr"], "tokens": int(m["tokens"]), "loss_tokens": int(m["loss_tokens"]),
                  "tokens_per_s": m["tokens"] / seconds, "step_seconds": seconds,
                  **step_rate(hf, micro_batches, seconds)}
        if t.eval_every and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps):
            v, _ = engine.forward_only(engine.fit_all(valid_batches), sft_loss, METRICS)
            record["valid_loss"] = v["nll_sum"] / max(v["loss_tokens"], 1.0)
        return record

    return run_steps(recipe, engine, "sft", one_step, ["loss", "valid_loss"], "loss.png", stop_after)
