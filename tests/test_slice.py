"""`make-slice`: a real-width GLM-5.x with fewer layers (glm5_bridge/slice.py).

The real widths (4.8B parameters at 4 layers) are too big for the CPU suite, so the file format and
the model are checked on a slice with the tiny widths (same code path, config overrides), and the
real-width config on its own. Reference: transformers 5.23 (GlmMoeDsaForCausalLM) in fp32."""

import json
import math

import pytest
import torch
from safetensors import safe_open

from glm5_bridge.model.config import load_preset_dict
from glm5_bridge.model.validate import expected_tensors, validate_checkpoint
from glm5_bridge.slice import make_slice_checkpoint, slice_config
from glm5_bridge.tiny import TINY


def test_real_width_config_keeps_everything_but_layers_and_experts():
    preset, cfg = load_preset_dict("GLM-5.2"), slice_config("GLM-5.2", 4, 16)
    changed = {k for k in preset if preset[k] != cfg[k]}
    assert changed == {"num_hidden_layers", "n_routed_experts", "indexer_types"}
    assert cfg["indexer_types"] == ["full", "full", "full", "shared"] == preset["indexer_types"][:4]
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["index_topk"], cfg["num_experts_per_tok"]) == (6144, 154880, 2048, 8)
    required, _ = expected_tensors(cfg)
    assert sum(math.prod(s) for s in required.values()) == 4_804_478_496  # 4 layers + MTP, 16 experts
    with pytest.raises(ValueError, match="--experts must be between num_experts_per_tok"):
        slice_config("GLM-5.2", 4, 4)


@pytest.fixture(scope="module")
def small_slice(tmp_path_factory):
    widths = {k: v for k, v in TINY.items() if k not in ("num_hidden_layers", "n_routed_experts")}
    widths["head_dim"] = widths["qk_rope_head_dim"]
    path = tmp_path_factory.mktemp("slice") / "hf"
    return make_slice_checkpoint("GLM-5.2", path, layers=4, experts=8, shard_gb=0.0005, **widths)


def test_slice_files_are_sharded_bf16_with_an_index(small_slice):
    index = json.loads((small_slice / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and all((small_slice / s).is_file() for s in shards)
    validate_checkpoint(small_slice)  # config ⇄ headers, every tensor present with its shape
    total, dtypes = 0, {}
    for shard in shards:
        with safe_open(small_slice / shard, "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                total += t.numel() * t.element_size()
                dtypes[name] = t.dtype
                if name.endswith("q_b_proj.weight"):  # 5 × initializer_range (module docstring)
                    assert abs(t.float().std().item() - 0.5) < 0.02
                elif name == "lm_head.weight":
                    assert abs(t.float().std().item() - 0.25) < 0.02
    assert index["metadata"]["total_size"] == total
    assert {n for n, d in dtypes.items() if d == torch.float32} == {n for n in dtypes if n.endswith("e_score_correction_bias")}
    cfg = json.loads((small_slice / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 4 and cfg["n_routed_experts"] == 8 and cfg["num_nextn_predict_layers"] == 1
    assert any(".layers.4.eh_proj" in n for n in dtypes)  # the MTP layer


def test_bf16_slice_next_token_logprobs_match_transformers(small_slice):
    """Packed thd, fp32 compute on the bf16 weights (a bf16 checkpoint builds bf16 parameters unless
    told otherwise): Megatron vs transformers ≤ 2e-5; the bf16 floor is reported beside it."""
    from glm5_bridge.parity import logprob_parity

    r = logprob_parity(small_slice, [40, 30], dtype="float32", backend="megatron")
    assert r["megatron_vs_hf_fp32"]["max"] <= 2e-5
    assert r["floor_hf_bf16_vs_fp32"]["max"] > 100 * r["megatron_vs_hf_fp32"]["max"]


def test_fp32_recipe_on_a_bf16_checkpoint_trains_in_fp32(small_slice, tmp_path):
    """Every real checkpoint stores bf16, and megatron-bridge builds parameters in the HF config's
    dtype: an fp32 recipe (model.bf16 false, the CPU default) must still get fp32 parameters, or
    the fp32 optimizer refuses their bf16 gradients (it did: 'grad_dtype BFloat16')."""
    from glm5_bridge.train.engine import Engine
    from glm5_bridge.train.recipe import load_recipe
    from glm5_bridge.train.sft import sft_loss
    from glm5_bridge.train.data import pack

    recipe = load_recipe(None, [f"model.checkpoint={small_slice}", f"train.output_dir={tmp_path / 'run'}"])
    engine = Engine(recipe)
    assert {p.dtype for p in engine.chunk.parameters()} == {torch.float32}
    batch = pack([(list(range(5, 45)), [0] * 10 + [1] * 30)], 256)
    m = engine.step([engine.fit(batch)], sft_loss, ["nll_sum", "loss_tokens"])
    assert math.isfinite(m["nll_sum"]) and m["loss_tokens"] == 30 and m["grad_norm"] > 0


def test_a_bf16_run_exports_and_resumes(tiny_checkpoint, tmp_path):
    """model.bf16: megatron wraps the chunk in Float16Module, whose parameter names gain "module.";
    the adapters must still be found in the run's checkpoint (the export on the GPU failed with
    'checkpoint lacks adapter module.decoder…' before the engine named them on the inner chunk)."""
    from glm5_bridge.cli import main

    run = tmp_path / "run"
    args = ["train", "tiny_lora_sft", f"model.checkpoint={tiny_checkpoint('GLM-5.2')}", "model.bf16=true",
            "train.steps=1", "train.save_every=1", "data.limit=8", "data.max_tokens=128", "lora.dim=4",
            f"train.output_dir={run}", "export.kind=none", "train.tensorboard_dir=none"]
    assert main(args) == 0
    assert main(["export", str(run), str(tmp_path / "adapter"), "--kind", "adapter"]) == 0
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert main([*args, "train.steps=2"]) == 0  # resumes from step 1
    assert [h["step"] for h in json.loads((run / "history.json").read_text())] == [1, 2]
