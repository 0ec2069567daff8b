"""`glm5-bridge train` on one GPU through the engine (train/engine.py): the fused kernels
(dsa_attention_backend: tilelang), bf16, NCCL, on the tiny GLM-5.2 with the kernels' widths
(kv_lora_rank 512, qk_rope_head_dim 64, index_head_dim 128). The loss falls, tokens/s is reported,
and a run resumed from its step-6 checkpoint continues the uninterrupted one: its history is the
checkpoint's, and the continued losses agree up to the backward's fp32 atomic dKV adds, which make
GPU runs differ in the last bits from run to run (the CPU tests show the restore itself is exact).
Run with scripts/gpu_tests.sh."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
KERNEL_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128)
ARGS = ["model.dsa_attention_backend=tilelang", "model.bf16=true", "data.limit=400", "data.max_tokens=1024",
        "train.global_batch_size=2", "train.steps=12", "train.save_every=6", "train.warmup_steps=2",
        "lora.dim=8", "export.kind=none"]


def _train(checkpoint: Path, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "glm5_bridge", "train", str(ROOT / "recipes" / "tiny_lora_sft.yaml"),
           f"model.checkpoint={checkpoint}", f"train.output_dir={out}", *ARGS]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "history.json").read_text())


def test_train_resume_on_one_gpu_with_fused_kernels(tmp_path):
    from glm5_bridge.tiny import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint("GLM-5.2", tmp_path / "hf", seed=0, **KERNEL_DIMS)
    history = _train(checkpoint, tmp_path / "run")
    losses = [h["loss"] for h in history]
    speed = sum(h["tokens_per_s"] for h in history[2:]) / len(history[2:])
    print(f"RESULT gpu_trainer loss_first={losses[0]:.4f} loss_last={losses[-1]:.4f} tokens_per_s={speed:.0f} "
          f"grad_norm_first={history[0]['grad_norm']:.3f}", flush=True)
    assert len(history) == 12 and losses[-1] < losses[0] - 0.2
    assert all(h["tokens_per_s"] > 0 and h["tokens"] > 0 for h in history)

    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_0000012")
    (resumed / "checkpoints" / "latest").write_text("step_0000006")
    (resumed / "history.json").unlink()
    again = _train(checkpoint, resumed)
    assert [h["loss"] for h in again[:6]] == losses[:6]  # the checkpoint's history, as saved
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(again[6:], history[6:]))
    print(f"RESULT gpu_trainer_resume continued_loss_max_abs_diff={diff:.3e}", flush=True)
    assert diff < 2e-2
