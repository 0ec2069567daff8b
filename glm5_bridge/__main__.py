"""`python -m glm5_bridge …` is `glm5-bridge …`; under torchrun every rank runs it:

    torchrun --nproc-per-node 2 -m glm5_bridge train recipes/tiny_lora_sft.yaml train.global_batch_size=4
"""

import sys

from glm5_bridge.cli import entry

sys.exit(entry())
