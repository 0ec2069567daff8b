"""The main job on the embedded default: a tiny GLM-5.2 made locally, converted to Megatron, run,
exported back to HF and verified against transformers. Runs on a CPU in well under a minute."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def run(workdir: str = "runs/demo") -> int:
    from safetensors.torch import load_file

    from glm5_bridge.convert import hf_to_megatron, load_megatron_checkpoint, megatron_to_hf
    from glm5_bridge.testing import load_hf, make_tiny_checkpoint, megatron_logits

    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    hf_dir, mcore_dir, back_dir = work / "hf", work / "megatron", work / "hf_export"

    print(f"[1/4] tiny GLM-5.2 (IndexShare, MTP) → {hf_dir}")
    make_tiny_checkpoint("GLM-5.2", hf_dir, seed=0)
    print(f"[2/4] HF → Megatron distributed checkpoint → {mcore_dir}")
    hf_to_megatron(hf_dir, mcore_dir, overwrite=True)

    print("[3/4] Megatron forward vs transformers")
    _, model = load_megatron_checkpoint(mcore_dir)
    hf = load_hf(hf_dir)
    ids = torch.randint(0, hf.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits_diff = (megatron_logits(model.eval(), ids) - hf(input_ids=ids).logits).abs().max().item()

    print(f"[4/4] Megatron → HF → {back_dir}")
    megatron_to_hf(mcore_dir, back_dir, overwrite=True)
    src, out = load_file(hf_dir / "model.safetensors"), load_file(back_dir / "model.safetensors")
    identical = sum(torch.equal(src[k], out[k]) for k in src if k in out)
    with torch.no_grad():
        reload_diff = (load_hf(back_dir)(input_ids=ids).logits - hf(input_ids=ids).logits).abs().max().item()

    summary = {
        "logits_max_abs_diff_megatron_vs_transformers": logits_diff,
        "tensors_bit_identical_after_round_trip": f"{identical}/{len(src)}",
        "exported_keys_match": set(src) == set(out),
        "logits_max_abs_diff_exported_vs_source": reload_diff,
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    ok = logits_diff <= 1e-5 and identical == len(src) and set(src) == set(out) and reload_diff == 0.0
    print("PARITY OK" if ok else "PARITY FAILED")
    return 0 if ok else 1
