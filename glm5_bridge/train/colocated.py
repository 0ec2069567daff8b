"""A colocated RL loop that needs no server: transformers `generate` on the policy's merged HF
weights is the rollout engine, its indexer top-k per computing layer is captured as the rollout's
replay payload, a reward checks the arithmetic answer, the Megatron side takes a LoRA RL step (with
or without replay), and the merged weights are synced back into the rollout model after each step.

Real rollout engines run their indexer in low precision with their own kernels, so their top-k
differs from a recomputation in training for a few queries. `rollout_indexer_dtype="bfloat16"`
reproduces that on a CPU: the rollout model's indexers score in bf16 while everything else stays
fp32. With replay on, training attends to exactly the rollout's keys and the train↔rollout gap is
fp32 noise; with replay off it also contains every selection the two indexers disagree on.
"""

from __future__ import annotations

import re
from contextlib import contextmanager

import torch

from glm5_bridge.hf import fuse
from glm5_bridge.model.payload import ReplayLayout, RequestTopk, encode_routed_experts
from glm5_bridge.train.data import arithmetic_problems, load_tokenizer
from glm5_bridge.train.recipe import Recipe
from glm5_bridge.train.rl import Rollout, _fill_advantages, rl_step, rollout_batch


def sync_weights(bridge, model, hf_model) -> None:
    """Megatron policy (LoRA merged) → the transformers rollout model, in memory."""
    weights = {k: v.clone() for k, v in bridge.export_hf_weights([model], cpu=True, show_progress=False,
                                                                 merge_adapter_weights=True)}
    missing, _ = hf_model.load_state_dict(fuse(weights, hf_model), strict=False)
    if missing:
        raise RuntimeError(f"weight sync left {len(missing)} rollout parameters unset, e.g. {missing[0]}")


class IndexerCapture:
    """Hooks every indexer of a transformers GlmMoeDsa model and assembles, per generated request,
    its top-k: int32 [len(tokens) − 1, computing layers, index_topk], request-local key positions,
    −1 padded (`RequestTopk.to_sglang(capture.layout)` gives sglang's every-layer form). With
    `routes`, every MoE router's chosen experts too (`routed_experts`: [len(tokens) − 1, MoE layers,
    num_experts_per_tok]), as sglang's routed-experts capture sends them."""

    def __init__(self, hf_model, dtype: torch.dtype = torch.float32, routes: bool = False):
        self.indexers = [layer.self_attn.indexer for layer in hf_model.model.layers if layer.self_attn.indexer is not None]
        self.gates = [layer.mlp.gate for layer in hf_model.model.layers if getattr(layer.mlp, "gate", None) is not None] \
            if routes else []
        self.layout = ReplayLayout.from_hf_config(hf_model.config)
        self.topk = self.layout.index_topk
        self.dtype = dtype
        self.rows: list[list[torch.Tensor]] = []
        self.route_rows: list[list[torch.Tensor]] = []

    @contextmanager
    def capturing(self):
        self.rows = [[] for _ in self.indexers]
        self.route_rows = [[] for _ in self.gates]
        originals = [ix.forward for ix in self.indexers]
        for slot, ix in enumerate(self.indexers):
            ix.forward = self._wrap(slot, ix, originals[slot])
        # the router returns (logits, weights, expert ids [tokens, top-k]) for the newest tokens
        hooks = [gate.register_forward_hook(lambda _m, _a, out, j=j: self.route_rows[j].append(out[2].to(torch.int32).cpu()))
                 for j, gate in enumerate(self.gates)]
        try:
            yield self
        finally:
            for ix, fwd in zip(self.indexers, originals):
                ix.forward = fwd
            for h in hooks:
                h.remove()

    def routed_experts(self, num_tokens: int) -> torch.Tensor:
        """int32 [num_tokens − 1, MoE layers, num_experts_per_tok] of the request just generated."""
        return torch.stack([torch.cat(rows)[: num_tokens - 1] for rows in self.route_rows], dim=1)

    def _wrap(self, slot, indexer, forward):
        low_precision = self.dtype != torch.float32

        device_type = next(indexer.parameters()).device.type

        def captured(*args, **kwargs):
            # autocast runs the indexer's projections and score matmuls in the engine-like dtype
            # without touching its fp32 weights.
            with torch.autocast(device_type, dtype=self.dtype, enabled=low_precision):
                idx = forward(*args, **kwargs)
            self.rows[slot].append(self._padded(idx[0]))
            return idx
        return captured

    def _padded(self, idx: torch.Tensor) -> torch.Tensor:
        """[q, k ≤ index_topk] indices of the newest q queries → [q, index_topk], −1 filled."""
        out = torch.full((idx.shape[0], self.topk), -1, dtype=torch.int32)
        out[:, : idx.shape[1]] = idx.to(torch.int32)
        return out

    def payload(self, num_tokens: int) -> RequestTopk:
        """Keys after their query → −1: the reference indexer ranks masked keys last but still
        returns them when a query sees fewer than index_topk keys."""
        layers = []
        for rows in self.rows:
            t = torch.cat(rows)[: num_tokens - 1]
            pos = torch.arange(t.shape[0])[:, None]
            layers.append(torch.where(t > pos, torch.full_like(t, -1), t))
        return RequestTopk(torch.stack(layers, dim=1))


def answer_reward(tokenizer, problem: dict, completion_ids: list[int]) -> float:
    """1 when the completion's first number is the answer, 0.1 for any number (format), else 0."""
    text = tokenizer.decode(completion_ids, skip_special_tokens=True)
    found = re.search(r"-?\d+", text)
    if found is None:
        return 0.0
    return 1.0 if found.group() == problem["messages"][1]["content"] else 0.1


def generate_rollouts(hf_model, tokenizer, problems, capture: IndexerCapture, max_new_tokens: int,
                      generator: torch.Generator) -> list[dict]:
    """Rows in the rollout-file format of train/rl.py (sglang-style `meta_info` included)."""
    rows = []
    for i, problem in enumerate(problems):
        prompt = tokenizer.apply_chat_template(problem["messages"][:1], add_generation_prompt=True, tokenize=True)
        prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])
        with capture.capturing(), torch.no_grad():
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
            out = hf_model.generate(torch.tensor([prompt], device=hf_model.device), max_new_tokens=max_new_tokens, do_sample=True,
                                    temperature=1.0, top_k=0, top_p=1.0, output_scores=True,
                                    return_dict_in_generate=True, eos_token_id=tokenizer.eos_token_id,
                                    pad_token_id=tokenizer.eos_token_id)
            tokens = out.sequences[0].tolist()
            completion = tokens[len(prompt):]
            # Rollout log-probs of the sampled tokens under the sampling distribution (temperature 1).
            logprobs = [0.0] * len(prompt) + [torch.log_softmax(s[0].float(), -1)[t].item()
                                              for s, t in zip(out.scores, completion)]
            payload = capture.payload(len(tokens))
            routes = ({"routed_experts": encode_routed_experts(capture.routed_experts(len(tokens)), capture.layout)}
                      if capture.gates else {})
        row = {"tokens": tokens, "loss_mask": [0] * len(prompt) + [1] * len(completion),
               "rollout_logprobs": logprobs, "reward": answer_reward(tokenizer, problem, completion),
               "group": problem["messages"][0]["content"],
               "meta_info": {**payload.to_sglang(capture.layout), **routes, "prompt_tokens": len(prompt),
                             "completion_tokens": len(completion)}}
        rows.append(row)
    return rows


def colocated_rl(recipe: Recipe, stop_after: int | None = None) -> dict:
    """`recipe.train.steps` rounds of weight sync → generate → reward → RL step on the engine, with
    checkpoints and resume like the other trainers (a step's rollouts depend on its index and the
    synced weights only, so a resumed run generates what the uninterrupted one would). The Megatron
    step replays the captured top-k when `recipe.rl.replay`. One data-parallel rank: the rollouts of
    a step are one micro-batch (TP / PP / EP are fine)."""
    from glm5_bridge.hf import load_hf
    from glm5_bridge.train.engine import Engine, data_parallel_info
    from glm5_bridge.train.run import check_run_outputs, run_steps

    t, rl = recipe.train, recipe.rl
    check_run_outputs(recipe)
    engine = Engine(recipe)
    if data_parallel_info()[1] != 1:
        raise ValueError("the colocated RL loop runs one data-parallel rank; use TP / PP / EP, or RL on a rollout file")
    tokenizer = load_tokenizer(recipe.model.checkpoint)
    hf_model = load_hf(recipe.model.checkpoint)
    capture = IndexerCapture(hf_model, getattr(torch, rl.rollout_indexer_dtype))
    problems = arithmetic_problems(t.steps * rl.prompts_per_step, seed=recipe.data.seed)
    vocab = hf_model.config.vocab_size

    def one_step(step: int) -> dict:
        sync_weights(engine.bridge, engine.chunk, hf_model)
        chosen = problems[step * rl.prompts_per_step:(step + 1) * rl.prompts_per_step]
        generator = torch.Generator().manual_seed(t.seed * 1_000_003 + step)
        rows = generate_rollouts(hf_model, tokenizer, [p for p in chosen for _ in range(rl.samples_per_prompt)],
                                 capture, rl.max_new_tokens, generator)
        rollouts = [Rollout(r, f"step {step + 1} rollout {i}", vocab, capture.layout) for i, r in enumerate(rows)]
        _fill_advantages(rollouts)
        record = rl_step(engine, engine.fit_all([rollout_batch(rollouts, vocab)]), recipe, step + 1)
        record["reward"] = sum(float(r.reward) for r in rollouts) / len(rollouts)
        return record

    return run_steps(recipe, engine, "colocated rl", one_step, ["reward", "logprob_abs_diff_mean", "kl_rollout_train"],
                     "rl.png", stop_after)
