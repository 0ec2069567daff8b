"""The README's main job (glm5-bridge demo), shortened: every stage runs and its checks hold."""

import json

from glm5_bridge.demo import run


def test_demo_main_job(tmp_path):
    assert run(str(tmp_path), sft_steps=12) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["convert_logits_max_abs_diff"] <= 1e-5
    assert summary["convert_tensors_bit_identical"] == "310/310"
    assert summary["export_logits_max_abs_diff"] <= 5e-5  # fp32 reordering, see demo.py
    assert summary["sft_loss_last"] < summary["sft_loss_first"]
    assert len(summary["answers"]) == 5 and (tmp_path / "sft" / "loss.png").is_file()
