"""The README.md (model card) every export carries: what the folder is, the base model it was
trained from, the LoRA configuration, the recipe and the final metrics, in the Hub's card form
(YAML front matter: base_model, library_name, tags).

    card = model_card("adapter", base="zai-org/GLM-5.2", lora={"dim": 16, "alpha": 32, "dropout": 0.0},
                      recipe_yaml=to_yaml(recipe), history=history)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from glm5_bridge import __version__

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def base_model_id(checkpoint) -> str | None:
    """The base checkpoint's Hub id when its config.json names one (`_name_or_path` of the form
    org/name, not a local folder), else the checkpoint's resolved path; None without a checkpoint."""
    if checkpoint is None:
        return None
    folder = Path(checkpoint)
    try:
        named = json.loads((folder / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        named = None
    if isinstance(named, str) and _HUB_ID.match(named) and not Path(named).exists():
        return named
    return str(folder.resolve())


def model_card(kind: str, base: str | None, lora: dict | None, recipe_yaml: str | None = None,
               history: list[dict] | None = None) -> str:
    """The card's text. `kind`: "merged" (a full checkpoint, LoRA folded in) or "adapter" (PEFT)."""
    what = ("the base model with its LoRA deltas folded into the weights (a full transformers checkpoint)"
            if kind == "merged" else "a PEFT LoRA adapter for the base model")
    front = ["---", f"base_model: {json.dumps(base or 'unknown')}",
             f"library_name: {'transformers' if kind == 'merged' else 'peft'}",
             "tags: [glm5-bridge, glm_moe_dsa, lora]", "---", ""]
    body = [f"# {'Merged LoRA checkpoint' if kind == 'merged' else 'LoRA adapter'} (glm5-bridge {__version__})", "",
            f"This folder holds {what}.", "", f"- Base model: `{base or 'unknown'}`"]
    if lora:
        body.append("- LoRA: " + ", ".join(f"{k} {v}" for k, v in lora.items()))
    if history:
        last = history[-1]
        metrics = ", ".join(f"{k} {_number(v)}" for k, v in last.items() if k != "step" and isinstance(v, (int, float)))
        body.append(f"- After step {last.get('step', len(history))}: {metrics}")
    body.append("")
    if kind == "adapter":
        body += ["Load it with PEFT:", "", "```python", "from peft import PeftModel",
                 "from transformers import AutoModelForCausalLM", "",
                 f"base = AutoModelForCausalLM.from_pretrained({json.dumps(base or 'BASE')})",
                 "model = PeftModel.from_pretrained(base, \"THIS_FOLDER\")", "```", ""]
    else:
        body += ["Load it with transformers:", "", "```python", "from transformers import AutoModelForCausalLM", "",
                 "model = AutoModelForCausalLM.from_pretrained(\"THIS_FOLDER\")", "```", ""]
    if recipe_yaml:
        body += ["## Recipe", "", "```yaml", recipe_yaml.rstrip(), "```", ""]
    return "\n".join(front + body)


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
