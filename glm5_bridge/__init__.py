"""glm5-bridge: GLM-5 / GLM-5.1 / GLM-5.2 with Megatron, on top of megatron-core and megatron-bridge.

`import glm5_bridge` installs the few CPU / no-TE workarounds (compat.py) and registers our
bridge for `GlmMoeDsaForCausalLM`, so the standard calls work unchanged:

    from megatron.bridge import AutoBridge
    bridge = AutoBridge.from_hf_pretrained(path)
    model = bridge.to_megatron_model(wrap_with_ddp=False)
"""

import logging
import warnings

# Import-time notices from megatron about optional packages we deliberately run without (TE, apex,
# absl, modelopt's transformers pin); real warnings still show.
for _pattern in ("Transformer Engine and Apex", "Apex is not installed", "absl.logging", "transformer-engine>=",
                 "is not tested with current version of modelopt", "`torch.jit.script` is deprecated"):
    warnings.filterwarnings("ignore", message=f".*{_pattern}.*")
for _logger in ("megatron.bridge.utils.import_utils", "megatron.bridge.models.gemma.gemma2_provider"):
    logging.getLogger(_logger).addFilter(lambda record: record.levelno >= logging.WARNING)

from glm5_bridge import compat  # noqa: E402

compat.install()

from glm5_bridge.model.bridge import AutoBridge, GLM5Bridge, GLM5ModelProvider, build_megatron_model  # noqa: E402  (registers the bridge)
from glm5_bridge.model.config import PRESETS, indexer_types, load_hf_config  # noqa: E402
from glm5_bridge.testing import make_tiny_checkpoint  # noqa: E402

__all__ = ["AutoBridge", "GLM5Bridge", "build_megatron_model", "GLM5ModelProvider", "PRESETS", "indexer_types", "load_hf_config",
           "make_tiny_checkpoint"]
