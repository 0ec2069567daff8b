"""The README's main job (glm5-bridge demo): every stage runs and its checks hold."""

import json

from glm5_bridge.demo import run


def test_demo_main_job(tmp_path):
    assert run(str(tmp_path)) == 0  # the recipe's 60 steps: what the held-out accuracy needs
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["heldout_exact_match_before"] <= 0.1 and summary["heldout_exact_match_after"] >= 0.8
    assert summary["convert_logits_max_abs_diff"] <= 1e-5
    assert summary["convert_tensors_bit_identical"] == "310/310"
    assert summary["export_logits_max_abs_diff"] <= 5e-5  # fp32 reordering, see demo.py
    assert summary["sft_loss_last"] < summary["sft_loss_first"]
    assert len(summary["answers"]) == 5 and (tmp_path / "sft" / "loss.png").is_file()
    # the merged export carries its model card: base, LoRA, final metrics, recipe
    (card,) = (tmp_path / "sft").glob("export_*/README.md")
    text = card.read_text()
    assert f'base_model: "{(tmp_path / "hf").resolve()}"' in text and "library_name: transformers" in text
    assert "- LoRA: dim 16, alpha 32" in text and "- After step 60: loss " in text and "## Recipe" in text
