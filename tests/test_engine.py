"""The training engine (glm5_bridge/train/engine.py) gives the same run at every layout: real
`glm5-bridge train` processes on the tiny GLM-5.2 (CPU, gloo; 2 ranks through torchrun) against one
process with the same global batch. Per-step loss and the final LoRA weights within 1e-5 for DP 2,
PP 2, TP 2 and EP 2; a DP 2 run resumed from its step-2 checkpoint repeats the uninterrupted run bit
for bit, and resumed at TP 2 continues within 1e-5; RL on a rollout file likewise (DP 2 against DP 1,
exact resume)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
STEPS = 4
COMMON = ["data.limit=48", "data.max_tokens=256", "lora.dim=4", "train.global_batch_size=4", f"train.steps={STEPS}",
          "train.save_every=1", "train.warmup_steps=1", "export.kind=none", "train.tensorboard_dir=none"]
LAYOUTS = {
    "dp2": [],
    "pp2": ["model.pipeline_model_parallel_size=2", "model.pipeline_stage_layers=[6,1]"],
    "tp2": ["model.tensor_model_parallel_size=2"],
    "ep2": ["model.expert_model_parallel_size=2"],
    "cp2": ["model.context_parallel_size=2"],
    "dp2_distributed_optimizer": ["train.use_distributed_optimizer=true"],
}


def _train(out: Path, checkpoint: Path, ranks: int, *overrides: str, recipe: str = "tiny_lora_sft.yaml") -> list[dict]:
    from glm5_bridge.distributed import free_port

    launcher = [sys.executable, "-m", "glm5_bridge"] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
         str(free_port()), "-m", "glm5_bridge"]
    cmd = [*launcher, "train", str(ROOT / "recipes" / recipe), f"model.checkpoint={checkpoint}",
           f"train.output_dir={out}", *COMMON, *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "history.json").read_text())


def _adapters(out: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    """The LoRA weights of a checkpoint, whole (dist_checkpointing joins the shards)."""
    from megatron.core.dist_checkpointing import load_plain_tensors

    from glm5_bridge.compat import init_cpu_process_group

    init_cpu_process_group()
    tensors = load_plain_tensors(str(out / "checkpoints" / f"step_{step:07d}"))
    return {k: v for k, v in tensors.items() if ".adapter." in k and "optimizer" not in k and k.endswith(".weight")}


def _max_diff(a: list[dict], b: list[dict], key: str = "loss") -> float:
    assert [h["step"] for h in a] == [h["step"] for h in b]
    return max(abs(x[key] - y[key]) for x, y in zip(a, b))


def _timeless(history: list[dict]) -> list[dict]:
    """Everything a step reports but its speed."""
    return [{k: v for k, v in h.items() if k not in ("tokens_per_s", "step_seconds", "tflops_per_gpu", "mfu")}
            for h in history]


def _truncated(src: Path, dst: Path, step: int) -> Path:
    """A copy of a run as a kill right after saving `step` would leave it."""
    shutil.copytree(src, dst)
    for folder in (dst / "checkpoints").glob("step_*"):
        if int(folder.name.split("_")[1]) > step:
            shutil.rmtree(folder)
    (dst / "checkpoints" / "latest").write_text(f"step_{step:07d}")
    (dst / "history.json").unlink()
    return dst


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("engine") / "one"
    return out, _train(out, tiny_checkpoint("GLM-5.2"), 1)


@pytest.fixture(scope="module")
def dp2(tiny_checkpoint, reference):
    out = reference[0].parent / "dp2"
    return out, _train(out, tiny_checkpoint("GLM-5.2"), 2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_equals_one_process(layout, tiny_checkpoint, reference, dp2):
    ref_out, ref = reference
    if layout == "dp2":
        out, history = dp2
    else:
        out = ref_out.parent / layout
        history = _train(out, tiny_checkpoint("GLM-5.2"), 2, *LAYOUTS[layout])
    assert len(history) == STEPS and history[-1]["loss"] < history[0]["loss"]
    assert _max_diff(history, ref) <= TOL
    assert [h["loss_tokens"] for h in history] == [h["loss_tokens"] for h in ref]  # the same global batches
    mine, theirs = _adapters(out), _adapters(ref_out)
    assert mine.keys() == theirs.keys() and len(mine) > 50
    assert max((mine[k] - theirs[k]).abs().max().item() for k in mine) <= TOL
    if layout == "dp2_distributed_optimizer":  # its Adam state does not restore without apex / TE: refused
        from types import SimpleNamespace

        from glm5_bridge.train import checkpoint
        from glm5_bridge.train.recipe import load_recipe

        recipe = load_recipe(ROOT / "recipes" / "tiny_lora_sft.yaml", [f"model.checkpoint={tiny_checkpoint('GLM-5.2')}",
                                                                      *COMMON])
        any_engine = SimpleNamespace(recipe=recipe)  # the same run, without the distributed optimizer
        with pytest.raises(ValueError, match=r"step_0000002: resuming with train.use_distributed_optimizer is not"):
            checkpoint.load(out / "checkpoints" / "step_0000002", any_engine)


def test_resume_at_dp2_is_exact_and_at_tp2_continues(tiny_checkpoint, dp2):
    out, uninterrupted = dp2
    again = _train(_truncated(out, out.parent / "dp2_resumed", 2), tiny_checkpoint("GLM-5.2"), 2)
    assert _timeless(again) == _timeless(uninterrupted)  # every field of every step, bit for bit
    mine, theirs = _adapters(out.parent / "dp2_resumed"), _adapters(out)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    other = _train(_truncated(out, out.parent / "tp2_resumed", 2), tiny_checkpoint("GLM-5.2"), 2,
                   "model.tensor_model_parallel_size=2")
    assert other[:2] == uninterrupted[:2] and _max_diff(other, uninterrupted) <= TOL


@pytest.fixture(scope="module")
def rollouts(tiny_checkpoint, tmp_path_factory):
    """Rollouts sampled by transformers from the tiny model, with their indexer top-k (sglang form)."""
    from transformers import AutoTokenizer

    from glm5_bridge.hf import load_hf
    from glm5_bridge.train.colocated import IndexerCapture, generate_rollouts
    from glm5_bridge.train.data import arithmetic_problems

    path = tiny_checkpoint("GLM-5.2")
    hf = load_hf(path)
    rows = generate_rollouts(hf, AutoTokenizer.from_pretrained(path), arithmetic_problems(8, seed=5),
                             IndexerCapture(hf, routes=True), max_new_tokens=4,
                             generator=torch.Generator().manual_seed(1))
    for i, row in enumerate(rows):
        row["reward"], row["group"] = float(i % 3 == 0), "all"  # one GRPO group: non-zero advantages
    out = tmp_path_factory.mktemp("rollouts") / "rollouts.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


RL = ["task=rl", "data.max_tokens=160", "train.global_batch_size=2", "rl.kl_coef=0.01", "train.lr=1e-3", "train.steps=3"]


@pytest.fixture(scope="module")
def rl_one(tiny_checkpoint, rollouts, tmp_path_factory):
    out = tmp_path_factory.mktemp("rl") / "one"
    return out, _train(out, tiny_checkpoint("GLM-5.2"), 1, *RL, f"data.train={rollouts}")


def test_rl_dp2_equals_dp1_and_resumes_exactly(tiny_checkpoint, rollouts, rl_one, tmp_path):
    out, one = rl_one
    two = _train(tmp_path / "two", tiny_checkpoint("GLM-5.2"), 2, *RL, f"data.train={rollouts}")
    assert one[0]["replay"] and one[0]["routing_replay"] and abs(one[0]["ratio_mean"] - 1) < 1e-5  # the rollout's policy
    assert _max_diff(one, two) <= TOL and _max_diff(one, two, "kl_rollout_train") <= TOL
    assert one[0]["grad_norm"] > 0 and one[-1]["kl_to_reference"] > 0  # the adapters moved away from the base
    again = _train(_truncated(out, tmp_path / "resumed", 2), tiny_checkpoint("GLM-5.2"), 1, *RL,
                   f"data.train={rollouts}")
    assert _timeless(again) == _timeless(one)


# RL with the rollouts' top-k and routed experts replayed, each rank on its share of the tokens: CP 2
# (every sequence in 4 chunks, padded at its end; replay rows and expert rows sliced to the rank's
# chunks) and TP 2 (sequence parallel: the routers see half the tokens each).
@pytest.mark.parametrize("layout", ["cp2", "tp2"])
def test_rl_with_replay_at_layout_equals_one_process(layout, tiny_checkpoint, rollouts, rl_one, tmp_path):
    _, one = rl_one
    other = _train(tmp_path / layout, tiny_checkpoint("GLM-5.2"), 2, *RL, f"data.train={rollouts}", *LAYOUTS[layout],
                   "train.save_every=0")  # no checkpoints: the history is compared
    assert all(h["replay"] and h["routing_replay"] for h in other)
    for key in ("loss", "kl_rollout_train", "logprob_abs_diff_mean"):
        assert _max_diff(one, other, key) <= TOL, key
