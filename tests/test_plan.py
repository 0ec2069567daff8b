"""The parameter count behind `glm5-bridge plan` equals a count of real checkpoint tensors."""

import math

import pytest
from safetensors import safe_open

from glm5_bridge.model.config import load_hf_config
from glm5_bridge.train.plan import Plan, count_parameters, memory_per_gpu


@pytest.mark.parametrize("variant", ["GLM-5", "GLM-5.2"])
def test_count_matches_the_tensors_of_a_checkpoint(tiny_checkpoint, variant):
    path = tiny_checkpoint(variant)
    with safe_open(path / "model.safetensors", "pt") as f:
        tensors = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert count_parameters(load_hf_config(path))["total"] == tensors


def test_glm5_headline_sizes():
    """Published: 744B total, 40B active (without the MTP layer)."""
    counts = count_parameters(load_hf_config("GLM-5"))
    assert abs((counts["total"] - counts["mtp"]) / 1e9 - 744) < 1
    assert 40 <= counts["active_per_token"] / 1e9 < 43


def test_memory_shrinks_with_parallelism():
    c = load_hf_config("GLM-5.2")
    one = memory_per_gpu(c, Plan(tp=8, ep=8))
    five = memory_per_gpu(c, Plan(tp=8, ep=8, pp=5, stage_layers=(14, 16, 16, 16, 16)))
    assert five["weights_bf16"] < one["weights_bf16"] / 4
    with pytest.raises(ValueError, match="must be 5 positive numbers summing to 78"):
        memory_per_gpu(c, Plan(tp=8, ep=8, pp=5, stage_layers=(14, 16, 16, 16)))
