"""LoRA RL: the policy-gradient step on a rollout file, and the colocated loop with R3 replay."""

import json

import pytest
import torch

from glm5_bridge.train.recipe import load_recipe


def _recipe(checkpoint, out, *extra):
    return load_recipe(None, ["task=rl", f"model.checkpoint={checkpoint}", f"train.output_dir={out}", "lora.dim=8",
                              "train.lr=1e-3", "export.kind=none", "train.deterministic=true", *extra])


@pytest.fixture(scope="module")
def rollout_file(tiny_checkpoint, tmp_path_factory):
    """Rollouts sampled by transformers from the tiny model itself (fp32), with sglang-style
    indexer top-k: the training policy at LoRA init is exactly the rollout policy."""
    from transformers import AutoTokenizer

    from glm5_bridge.train.data import arithmetic_problems
    from glm5_bridge.testing import load_hf
    from glm5_bridge.train.colocated import IndexerCapture, generate_rollouts

    path = tiny_checkpoint("GLM-5.2")
    hf = load_hf(path)
    rows = generate_rollouts(hf, AutoTokenizer.from_pretrained(path), arithmetic_problems(6, seed=3),
                             IndexerCapture(hf), max_new_tokens=4, generator=torch.Generator().manual_seed(0))
    for i, row in enumerate(rows):
        row["reward"] = float(i % 2)  # a spread of rewards: non-zero advantages
        row["group"] = "all"
    out = tmp_path_factory.mktemp("rollouts") / "rollouts.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def test_identical_policy_gives_ratio_one_and_zero_kl(tiny_checkpoint, rollout_file, tmp_path):
    from glm5_bridge.train.rl import train_rl

    recipe = _recipe(tiny_checkpoint("GLM-5.2"), tmp_path, f"data.train={rollout_file}", "train.steps=1")
    first = train_rl(recipe)["history"][0]
    assert first["replay"] is True
    assert abs(first["ratio_mean"] - 1) < 1e-5
    assert first["kl_rollout_train"] < 1e-9
    assert first["logprob_abs_diff_max"] < 1e-4
    assert first["grad_norm"] > 0  # rewards differ, so the step does move the adapters


def test_replay_payload_is_what_training_attends_to(tiny_checkpoint, rollout_file):
    """The replayed top-k decides the logprobs: shuffling the payload's keys within each causal
    window changes them, the untouched payload reproduces the rollout."""
    from glm5_bridge.model.payload import ReplayLayout, RequestTopk
    from glm5_bridge.testing import load_megatron
    from glm5_bridge.train.rl import load_rollouts, policy_logprobs, rollout_batch

    _, model = load_megatron(tiny_checkpoint("GLM-5.2"))
    model.eval()
    samples = load_rollouts(rollout_file, model.vocab_size, ReplayLayout.from_model_config(model.config))
    batch = rollout_batch(samples[:3], model.vocab_size)
    mask = batch.loss_mask[0]
    with torch.no_grad():
        replayed = policy_logprobs(model, batch, replay=True)
        assert ((replayed - batch.rollout_logprobs[0]).abs() * mask).max() < 1e-4
        mangled_requests = []
        for req in batch.replay:  # keep only the 2 oldest keys of every row: valid, but not the rollout's
            t = req.tensor()
            rows = torch.arange(t.shape[0])[:, None, None]
            slots = torch.arange(t.shape[2])[None, None, :]
            keep = (slots < 2) & (slots <= rows)
            mangled_requests.append(RequestTopk(torch.where(keep, slots.expand_as(t), torch.full_like(t, -1)).int()))
        batch.replay = mangled_requests
        mangled = policy_logprobs(model, batch, replay=True)
    assert ((mangled - replayed).abs() * mask).max() > 1e-2


def test_bad_rollout_rows_are_named(tmp_path):
    from glm5_bridge.model.payload import ReplayLayout
    from glm5_bridge.train.rl import load_rollouts

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"tokens": [1, 2, 3], "loss_mask": [0, 1], "rollout_logprobs": [0, 0, 0],
                                "reward": 1}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: loss_mask has 2 entries, tokens has 3"):
        load_rollouts(path, 256, ReplayLayout(("full",), 8))


def test_colocated_loop_replay_on_and_off(tiny_checkpoint, tmp_path):
    """transformers generates with a bf16 indexer (like an engine); Megatron trains in fp32. With
    replay the train↔rollout gap is fp32 noise; without it, the indexers' disagreements show."""
    from glm5_bridge.train.colocated import colocated_rl

    gaps = {}
    for replay in (True, False):
        recipe = _recipe(tiny_checkpoint("GLM-5.2"), tmp_path / str(replay), "rl.colocated=true", "train.steps=2",
                         f"rl.replay={str(replay).lower()}", "rl.rollout_indexer_dtype=bfloat16", "rl.kl_coef=0.01",
                         "rl.prompts_per_step=3")
        history = colocated_rl(recipe)["history"]
        assert len(history) == 2 and all("reward" in h for h in history)
        gaps[replay] = max(h["logprob_abs_diff_max"] for h in history)
    assert gaps[True] < 1e-4
    assert gaps[False] > 100 * gaps[True]


def test_moe_routing_replay_restores_the_rollout_experts(tiny_checkpoint, rollout_file, tmp_path):
    """Record each token's experts, move every router's bias so it would route elsewhere, then
    replay the recorded experts from an sglang-style `routed_experts` payload: the logprobs come
    back; computing the routing does not."""
    from glm5_bridge.model.payload import ReplayLayout, encode_routed_experts
    from glm5_bridge.train.routing_replay import recording_routes
    from glm5_bridge.testing import load_megatron
    from glm5_bridge.train.rl import load_rollouts, policy_logprobs, rollout_batch

    _, model = load_megatron(tiny_checkpoint("GLM-5.2"), moe_enable_routing_replay=True)
    model.eval()
    layout = ReplayLayout.from_model_config(model.config)
    samples = load_rollouts(rollout_file, model.vocab_size, layout)[:3]
    batch = rollout_batch(samples, model.vocab_size)
    with torch.no_grad(), recording_routes(model) as recorded:
        reference = policy_logprobs(model, batch, replay=True)
    routes = recorded[0]  # [T, moe layers, top-k]
    rows, start = [], 0
    for s in samples:
        n = len(s.tokens)
        rows.append({"tokens": s.tokens, "loss_mask": s.loss_mask, "rollout_logprobs": s.rollout_logprobs,
                     "advantage": 0.0, "meta_info": {"routed_experts": encode_routed_experts(routes[start:start + n - 1], layout)}})
        start += n
    path = tmp_path / "routed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    replayed_samples = load_rollouts(path, model.vocab_size, layout)
    replay_batch = rollout_batch(replayed_samples, model.vocab_size)
    assert replay_batch.routes is not None and replay_batch.routes[0].shape[1] == 6  # 6 MoE layers

    for name, router in model.named_modules():  # a different routing everywhere
        if hasattr(router, "expert_bias") and router.expert_bias is not None:
            router.expert_bias.add_(torch.linspace(-5, 5, router.expert_bias.numel()))
    mask = batch.loss_mask[0]
    with torch.no_grad():
        computed = policy_logprobs(model, replay_batch, replay=False)
        replayed = policy_logprobs(model, replay_batch, replay=True)
    assert ((computed - reference).abs() * mask).max() > 1e-2
    assert ((replayed - reference).abs() * mask).max() < 1e-5
