"""benchmarks/real_width.py on one GPU at GLM-5.2's real widths, reduced to a short run: 2 decoder
layers (both dense: GLM-5.2's first MoE and first IndexShare "shared" layer are the 4th; the MTP
layer is MoE), 8 routed experts, two packed sequences of 2560 + 1536 tokens (longer than top-k
2048), 6 SFT steps, 2 RL steps on 4 rollouts of ~2300 tokens. The full run is scripts/real_width.sh.
Run with scripts/gpu_tests.sh."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]


def test_real_width_reduced(tmp_path):
    out = tmp_path / "real_width.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "real_width.py"), "--work", str(tmp_path / "work"), "--out",
           str(out), "--layers", "2", "--experts", "8", "--lengths", "2560,1536", "--train-steps", "6",
           "--max-tokens", "4096", "--chats", "24", "--chat-numbers", "20,120", "--rl-steps", "2", "--rl-prompts", "2",
           "--rl-numbers", "380", "--rl-new-tokens", "16", "--steps", "slice,convert,parity,train,export,rl"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["convert"]["round_trip"]["bit_exact"]
    assert r["parity"]["max_over_floor_max"] <= 2
    train = r["train"]["fused"]
    assert train["loss_last"] < train["loss_first"] and train["mfu"] > 0
    for kind in ("merged", "adapter"):
        assert r["export"][kind]["parity"]["max_over_floor_max"] <= 2
    s = r["rl"]["summary"]
    print(f"RESULT real_width_reduced parity_over_floor={r['parity']['max_over_floor_max']:.2f} "
          f"tokens_per_s={train['tokens_per_s']:.0f} mfu={train['mfu']:.3f} "
          f"replay_on={s['replay_on_step1_logprob_abs_diff_mean']:.4f} "
          f"replay_off={s['replay_off_step1_logprob_abs_diff_mean']:.4f}", flush=True)
    assert s["replay_on_step1_logprob_abs_diff_mean"] < s["replay_off_step1_logprob_abs_diff_mean"]
