"""Shared fixtures: tiny checkpoints made once per session, one gloo process group per process."""

import pytest

import glm5_bridge
from glm5_bridge.testing import make_tiny_checkpoint

glm5_bridge.register()
glm5_bridge.enable_cpu_support()  # the tests run megatron-core's pieces on CPUs (compat.py)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(variant="GLM-5.2", seed=0) → path of a tiny HF checkpoint (cached)."""
    cache = {}

    def make(variant: str = "GLM-5.2", seed: int = 0):
        if (variant, seed) not in cache:
            folder = tmp_path_factory.mktemp(f"{variant.replace('.', '_')}_{seed}")
            cache[variant, seed] = make_tiny_checkpoint(variant, folder, seed)
        return cache[variant, seed]

    return make
