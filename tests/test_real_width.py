"""benchmarks/real_width.py --small: the real-width benchmark's steps on a CPU at the tiny widths
(fp32, unfused backend), each a real `python -m glm5_bridge …` process as on the GPU. The CPU
suite runs the make-slice and train steps (the loss falls; the step records carry TFLOP/s); the
parity the export step runs is checked in-process (test_slice.py), the exports themselves by
test_export.py, the RL step's rollouts (IndexerCapture with routes) below, RL from such a file by
test_engine.py and test_rl.py. The GPU run (scripts/real_width.sh) measures bf16, the fused kernels
and the rest; all steps ran on a CPU while it was written (docs/real_width.md)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_real_width_driver_on_cpu(tmp_path):
    out = tmp_path / "real_width.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "real_width.py"), "--small", "--work", str(tmp_path / "work"),
           "--out", str(out), "--steps", "slice,train", "--lengths", "40,30", "--train-steps", "4",
           "--max-tokens", "512", "--chats", "16", "--chat-numbers", "2,6", "--lr", "3e-3"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["slice"]["config"]["indexer_types"] == ["full", "full", "full", "shared"]
    train = r["train"]["unfused"]
    assert train["steps"] == 4 and train["loss_last"] < train["loss_first"] and train["tflops_per_gpu"] > 0
    assert "| train | unfused |" in subprocess.run([sys.executable, str(ROOT / "benchmarks" / "real_width.py"), "--out",
                                                 str(out), "--table"], capture_output=True, text=True).stdout


def test_rollout_capture_records_the_routers_choices(tiny_checkpoint):
    """IndexerCapture(routes=True) (real_width's rollouts): the routed experts a generated request
    carries are the ones transformers' routers choose for the whole sequence in one forward, and the
    payload passes the trainer's checks (sglang's form, every decoder layer)."""
    import torch

    from glm5_bridge.hf import load_hf
    from glm5_bridge.model.payload import decode_routed_experts
    from glm5_bridge.train.colocated import IndexerCapture, generate_rollouts
    from glm5_bridge.train.data import arithmetic_problems, load_tokenizer

    path = tiny_checkpoint("GLM-5.2")
    model, tokenizer = load_hf(path), load_tokenizer(path)
    capture = IndexerCapture(model, routes=True)
    row = generate_rollouts(model, tokenizer, arithmetic_problems(1), capture, 5, torch.Generator().manual_seed(0))[0]
    n = len(row["tokens"])
    routes = decode_routed_experts(row["meta_info"], capture.layout, n)  # [n - 1, MoE layers, top-k]
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _a, out: chosen.append(out[2]))
             for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        model(input_ids=torch.tensor([row["tokens"][:-1]]))
    for h in hooks:
        h.remove()
    expected = torch.stack(chosen, 1).to(torch.int32)
    assert routes.shape == expected.shape == (n - 1, len(chosen), model.config.num_experts_per_tok)
    assert torch.equal(routes.sort(-1).values, expected.sort(-1).values)
