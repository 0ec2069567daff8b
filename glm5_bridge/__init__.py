"""glm5-bridge: GLM-5 / GLM-5.1 / GLM-5.2 with Megatron, on top of megatron-core and megatron-bridge.

    from glm5_bridge import AutoBridge          # registers our bridge for GlmMoeDsaForCausalLM
    bridge = AutoBridge.from_hf_pretrained(path_or_preset)
    model = bridge.to_megatron_model(wrap_with_ddp=False)

`import glm5_bridge` itself is light and changes nothing in other libraries: the names below load
on first use. Importing `glm5_bridge.model.bridge` (which `AutoBridge`, `build_megatron_model` and
`register()` do) registers our bridge in megatron-bridge's registry, after which megatron-bridge's
own `AutoBridge` dispatches GLM-5 checkpoints here too. On a machine without CUDA or Transformer
Engine our provider applies the workarounds it needs when it builds a model; code that runs
megatron-core's training pieces there calls `enable_cpu_support()` first (compat.py says what it
changes).

Layout, imports pointing down (tests/test_layout.py checks it):
    kernels/    TileLang kernels and their torch references; imports nothing else of ours
    files, distributed, compat, hf     leaves: safe files, process helpers, upstream workarounds,
                                       transformers' side (reference model, expert layout)
    model/      source (path or preset), config, validate, bridge, spec, layers, attention, replay
    train/      LoRA, data, recipes, trainers, checkpoints, routing replay, export
    convert, parity, plan, tiny, demo, cli     what the `glm5-bridge` command runs
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "AutoBridge": "glm5_bridge.model.bridge",
    "GLM5Bridge": "glm5_bridge.model.bridge",
    "GLM5ModelProvider": "glm5_bridge.model.bridge",
    "build_megatron_model": "glm5_bridge.model.bridge",
    "PRESETS": "glm5_bridge.model.source",
    "indexer_types": "glm5_bridge.model.config",
    "load_hf_config": "glm5_bridge.model.config",
    "make_tiny_checkpoint": "glm5_bridge.tiny",
    "enable_cpu_support": "glm5_bridge.compat",
}

__all__ = [*_EXPORTS, "register", "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'glm5_bridge' has no attribute {name!r}")


def register() -> None:
    """Register our bridge for `GlmMoeDsaForCausalLM` with megatron-bridge (idempotent)."""
    import_module("glm5_bridge.model.bridge")
