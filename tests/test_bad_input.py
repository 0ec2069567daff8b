"""Bad input gets a clear error and nothing is lost (issue 9).

Every case in CASES runs `glm5-bridge` in-process (`glm5_bridge.cli.main`) on one bad input and
checks: exit status 2, the exact one-line error (naming the file, key or shape) as the last stderr
line with no traceback, no output left (the target does not exist, or an existing target is
unchanged) and no `.*.tmp-*` / `.*.old-*` folder beside it. When all cases pass, their number and
names go to tests/checked.json, from which the README's "What is checked" block is generated.

The rest of the file: the validator accepts every valid checkpoint (all tiny variants, a sharded
one, our own merged export; the presets' tensor count matches plan.py), one case of each class run
as a real process prints that one line and nothing else, a real full disk (tmpfs) is reported in
one line with nothing left on it, the source checkpoint is only read by convert + train + export,
and no pickle is loaded with arbitrary globals anywhere on those paths.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import _checked
from glm5_bridge.cli import main
from glm5_bridge.model.validate import CheckpointError, expected_tensors, read_header, validate_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SFT_RECIPE = ROOT / "recipes" / "tiny_lora_sft.yaml"
RL_RECIPE = ROOT / "recipes" / "tiny_lora_rl.yaml"
SHARD = "model.safetensors"


# ---------------------------------------------------------------------------------------- helpers

def _hashes(folder: Path) -> dict[str, tuple[str, int]]:
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if re.match(r"^\..+\.(tmp|old)-", p.name)] if folder.is_dir() else []


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(folder: Path, edit) -> Path:
    tensors = load_file(folder / SHARD)
    edit(tensors)
    save_file(tensors, folder / SHARD, metadata={"format": "pt"})
    return folder


def _edit_config(folder: Path, **changes) -> Path:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _shard(folder: Path) -> tuple[list[str], list[str]]:
    """Split model.safetensors into two shards with an index (as large checkpoints come)."""
    tensors = load_file(folder / SHARD)
    names = sorted(tensors)
    halves = names[: len(names) // 2], names[len(names) // 2:]
    weight_map = {}
    for i, half in enumerate(halves, 1):
        shard = f"model-0000{i}-of-00002.safetensors"
        save_file({n: tensors[n] for n in half}, folder / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in half})
    (folder / SHARD).unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return list(halves[0]), list(halves[1])


def _rollout(tokens, **extra) -> dict:
    n = len(tokens)
    return {"tokens": tokens, "loss_mask": [0] * (n // 2) + [1] * (n - n // 2), "rollout_logprobs": [0.0] * n,
            "reward": 1.0, **extra}


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sft(checkpoint, out, *extra) -> list[str]:
    return ["train", str(SFT_RECIPE), f"model.checkpoint={checkpoint}", f"train.output_dir={out}", "train.steps=2",
            "data.limit=16", "data.max_tokens=128", "lora.dim=4", "export.kind=none", *extra]


def _rl(checkpoint, out, data, *extra) -> list[str]:
    return ["train", str(RL_RECIPE), f"model.checkpoint={checkpoint}", f"train.output_dir={out}",
            f"data.train={data}", "rl.colocated=false", "train.steps=1", *extra]


def _chat(user: str, answer: str = "4") -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


# ---------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def source(tiny_checkpoint, tmp_path_factory):
    """A private copy of the tiny GLM-5.2 checkpoint and its file hashes (it must never change)."""
    path = _copy(tiny_checkpoint("GLM-5.2"), tmp_path_factory.mktemp("source") / "hf")
    return path, _hashes(path)


@pytest.fixture(scope="module")
def run(source, tmp_path_factory):
    """A 2-step LoRA SFT run (checkpoint after each step) through the CLI: what `export` reads."""
    out = tmp_path_factory.mktemp("run") / "sft"
    assert main(_sft(source[0], out, "train.save_every=1")) == 0
    assert (out / "checkpoints" / "latest").read_text() == "step_0000002"
    return out


@pytest.fixture(scope="module")
def megatron_checkpoint(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("mcore") / "mcore"
    assert main(["convert", str(source[0]), str(out)]) == 0
    return out


@dataclass
class Ctx:
    tmp: Path
    good: Path
    request: pytest.FixtureRequest
    monkeypatch: pytest.MonkeyPatch

    def fixture(self, name):
        return self.request.getfixturevalue(name)

    def broken(self, name: str = "hf") -> Path:
        return _copy(self.good, self.tmp / name)


@dataclass
class Case:
    argv: list[str]
    message: str | re.Pattern  # the text after "glm5-bridge <command>: error: "
    absent: list[Path] = field(default_factory=list)  # must not exist afterwards
    unchanged: list[Path] = field(default_factory=list)  # existed before; same files and bytes after


# ---------------------------------------------------------------------------------------- the cases
# Each returns the Case for a bad input it has just made under ctx.tmp.

def wrong_model_type(ctx):
    src = _edit_config(ctx.broken(), model_type="llama", architectures=["LlamaForCausalLM"])
    return Case(["convert", str(src), str(ctx.tmp / "out")],
                f"{src}/config.json: model_type is 'llama', expected 'glm_moe_dsa' (GLM-5 / 5.1 / 5.2)",
                [ctx.tmp / "out"])


def wrong_architecture(ctx):
    src = _edit_config(ctx.broken(), architectures=["DeepseekV3ForCausalLM"])
    return Case(["convert", str(src), str(ctx.tmp / "out")],
                f"{src}/config.json: architectures is ['DeepseekV3ForCausalLM'], expected ['GlmMoeDsaForCausalLM']",
                [ctx.tmp / "out"])


def missing_config(ctx):
    src = ctx.broken()
    (src / "config.json").unlink()
    return Case(["convert", str(src), str(ctx.tmp / "out")],
                f"{src}/config.json: not found (an HF checkpoint folder holds config.json and *.safetensors)",
                [ctx.tmp / "out"])


def config_not_json(ctx):
    src = ctx.broken()
    (src / "config.json").write_text('{"model_type": "glm_moe_dsa",')
    return Case(["convert", str(src), str(ctx.tmp / "out")],
                f"{src}/config.json: not valid JSON (Expecting property name enclosed in double quotes)",
                [ctx.tmp / "out"])


def config_rejected_by_transformers(ctx):
    src = _edit_config(ctx.broken(), num_hidden_layers=9)  # layer_types still lists 7
    return Case(["convert", str(src), str(ctx.tmp / "out")],
                f"{src}/config.json: transformers rejects this config (`num_hidden_layers` (9) must be equal to the "
                "number of `layer_types` (7))", [ctx.tmp / "out"])


def missing_shard(ctx):
    src = ctx.broken()
    _, second = _shard(src)
    (src / "model-00002-of-00002.safetensors").unlink()
    return Case(["convert", str(src), str(ctx.tmp / "out")],
                f"{src}/model.safetensors.index.json: names shard model-00002-of-00002.safetensors ({len(second)} "
                f"tensors, e.g. {second[0]}), which is missing from {src}", [ctx.tmp / "out"])


def truncated_safetensors(ctx):
    src = ctx.broken()
    size = (src / SHARD).stat().st_size
    with open(src / SHARD, "rb") as f:
        data = size - 8 - int.from_bytes(f.read(8), "little")
    os.truncate(src / SHARD, size - 4096)
    return Case(["convert", str(src), str(ctx.tmp / "out")],
                f"{src}/{SHARD}: truncated: the header describes {data} bytes of tensor data, the file holds "
                f"{data - 4096}", [ctx.tmp / "out"])


def missing_tensor(ctx):
    src = _edit_tensors(ctx.broken(), lambda t: t.pop("model.layers.2.self_attn.kv_b_proj.weight"))
    return Case(["convert", str(src), str(ctx.tmp / "out")],
                f"{src}: tensor model.layers.2.self_attn.kv_b_proj.weight (128, 32) is missing (1 missing in all)",
                [ctx.tmp / "out"])


def extra_tensor(ctx):
    def add(t):  # a ninth expert in a config of eight
        t["model.layers.1.mlp.experts.8.up_proj.weight"] = t["model.layers.1.mlp.experts.7.up_proj.weight"].clone()
    src = _edit_tensors(ctx.broken(), add)
    return Case(["convert", str(src), str(ctx.tmp / "out")],
                f"{src}/{SHARD}: tensor model.layers.1.mlp.experts.8.up_proj.weight is not part of a GLM-5.x "
                "checkpoint of this config (1 unexpected in all)", [ctx.tmp / "out"])


def renamed_tensor(ctx):
    def rename(t):
        t["model.layers.0.self_attn.q_a_prj.weight"] = t.pop("model.layers.0.self_attn.q_a_proj.weight")
    src = _edit_tensors(ctx.broken(), rename)
    return Case(["convert", str(src), str(ctx.tmp / "out")],
                f"{src}/{SHARD}: has tensor model.layers.0.self_attn.q_a_prj.weight the config does not imply, and "
                "tensor model.layers.0.self_attn.q_a_proj.weight (32, 64) is missing (renamed?; 1 unexpected, "
                "1 missing in all)", [ctx.tmp / "out"])


def wrong_shape(ctx):
    def shrink(t):
        t["model.layers.3.self_attn.q_b_proj.weight"] = t["model.layers.3.self_attn.q_b_proj.weight"][:64].clone()
    src = _edit_tensors(ctx.broken(), shrink)
    return Case(["convert", str(src), str(ctx.tmp / "out")],
                f"{src}/{SHARD}: tensor model.layers.3.self_attn.q_b_proj.weight has shape (64, 32), config implies "
                "(96, 32)", [ctx.tmp / "out"])


def config_disagrees_with_weights(ctx):
    src = _edit_config(ctx.broken(), kv_lora_rank=48)  # weights were made with 32
    return Case(["convert", str(src), str(ctx.tmp / "out")],
                f"{src}/{SHARD}: tensor model.layers.0.self_attn.kv_a_layernorm.weight has shape (32,), config "
                "implies (48,)",
                [ctx.tmp / "out"])


def wrong_dtype(ctx):
    def half(t):
        t["model.layers.0.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"].half()
    src = _edit_tensors(ctx.broken(), half)
    return Case(["convert", str(src), str(ctx.tmp / "out")],
                f"{src}/{SHARD}: tensor model.layers.0.self_attn.o_proj.weight has dtype F16, config.json says dtype "
                "float32 (accepted: BF16, F32)", [ctx.tmp / "out"])


def integer_tensor(ctx):
    def to_int(t):
        t["model.norm.weight"] = t["model.norm.weight"].to(torch.int32)
    src = _edit_tensors(ctx.broken(), to_int)
    return Case(["convert", str(src), str(ctx.tmp / "out")],
                f"{src}/{SHARD}: tensor model.norm.weight has dtype I32, config.json says dtype float32 "
                "(accepted: BF16, F32)", [ctx.tmp / "out"])


def pickle_weights_only(ctx):
    src = ctx.broken()
    (src / SHARD).unlink()
    torch.save({}, src / "pytorch_model.bin")
    return Case(["convert", str(src), str(ctx.tmp / "out")],
                f"{src}: has pytorch_model.bin but no *.safetensors; only safetensors weights are read (pickle files "
                "can run code on load)", [ctx.tmp / "out"])


def unknown_preset(ctx):
    return Case(["plan", "GLM-6"], "GLM-6: no such checkpoint folder (and not a preset: GLM-5, GLM-5.1, GLM-5.2)")


def unknown_source(ctx):
    return Case(["convert", "GLM-6", str(ctx.tmp / "out")],
                "GLM-6: no such checkpoint folder (and not a preset: GLM-5, GLM-5.1, GLM-5.2)", [ctx.tmp / "out"])


def preset_without_weights(ctx):
    return Case(["convert", "GLM-5.2", str(ctx.tmp / "out")],
                "'GLM-5.2' has a config but no weights here; pass the local path of the downloaded checkpoint (or "
                "load_weights=False for a randomly initialised model)", [ctx.tmp / "out"])


def recipe_typo_override(ctx):
    return Case(_sft(ctx.good, ctx.tmp / "run", "train.stpes=3"),
                "override train.stpes=3: Key 'stpes' not in 'TrainConfig'. Did you mean: 'steps'? (key: train.stpes)",
                [ctx.tmp / "run"])


def recipe_typo_in_file(ctx):
    recipe = ctx.tmp / "typo.yaml"
    recipe.write_text(f"model:\n  checkpoint: {ctx.good}\ntrain:\n  save_evry: 2\n  output_dir: {ctx.tmp / 'run'}\n")
    return Case(["train", str(recipe)], f"{recipe}: Key 'save_evry' not in 'TrainConfig'. Did you mean one of: "
                "'save_every', 'eval_every'? (key: train.save_evry)", [ctx.tmp / "run"])


def recipe_wrong_type(ctx):
    return Case(_sft(ctx.good, ctx.tmp / "run", "train.steps=many"),
                "override train.steps=many: Value 'many' of type 'str' could not be converted to Integer "
                "(key: train.steps)",
                [ctx.tmp / "run"])


def recipe_section_not_a_mapping(ctx):
    recipe = ctx.tmp / "flat.yaml"
    recipe.write_text("lora: 8\n")
    return Case(["train", str(recipe), f"train.output_dir={ctx.tmp / 'run'}"],
                f"{recipe}: lora must be a section (a mapping), got 8 (key: lora)", [ctx.tmp / "run"])


def recipe_not_yaml(ctx):
    recipe = ctx.tmp / "broken.yaml"
    recipe.write_text("train: [\n")
    return Case(["train", str(recipe)], f'{recipe}: not valid YAML (while parsing a flow node did not find expected '
                f'node content in "{recipe}", line 2, column 1)')


def missing_dataset(ctx):
    return Case(_sft(ctx.good, ctx.tmp / "run", f"data.train={ctx.tmp / 'nope.jsonl'}"),
                f"{ctx.tmp / 'nope.jsonl'}: dataset file not found", [ctx.tmp / "run"])


def dataset_not_json(ctx):
    data = ctx.tmp / "data.jsonl"
    data.write_text(json.dumps(_chat("What is 2 plus 2?")) + "\n{'messages': []}\n")
    return Case(_sft(ctx.good, ctx.tmp / "run", f"data.train={data}"),
                f"{data}:2: not valid JSON (Expecting property name enclosed in double quotes)", [ctx.tmp / "run"])


def sft_token_id_beyond_vocab(ctx):
    """The tokenizer knows more tokens than the model's 256-row embedding (not the checkpoint's own)."""
    from transformers import AutoTokenizer

    src = ctx.broken()
    tokenizer = AutoTokenizer.from_pretrained(src)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(200)])
    tokenizer.save_pretrained(src)
    token = tokenizer.convert_tokens_to_ids("<extra_199>")
    assert token >= 256
    data = _jsonl(ctx.tmp / "data.jsonl", [_chat("What is <extra_199>?")])
    return Case(_sft(src, ctx.tmp / "run", f"data.train={data}"),
                f"{data}: line 1: token id {token} is outside the vocabulary (size 256; does the tokenizer belong to "
                "the checkpoint?)", [ctx.tmp / "run"])


def rl_token_id_beyond_vocab(ctx):
    data = _jsonl(ctx.tmp / "rollouts.jsonl", [_rollout([5, 300, 7, 8])])
    return Case(_rl(ctx.good, ctx.tmp / "run", data), f"{data}:1: token id 300 is outside the vocabulary (size 256)",
                [ctx.tmp / "run"])


def sft_empty_sample(ctx):
    data = _jsonl(ctx.tmp / "data.jsonl", [_chat("What is 2 plus 2?"), {"messages": []}])
    return Case(_sft(ctx.good, ctx.tmp / "run", f"data.train={data}"),
                f"{data}: line 2: sample has no assistant turn to learn from", [ctx.tmp / "run"])


def sft_line_too_long(ctx):
    """A 4 MB chat line is refused by its length before tokenizing (which would take minutes)."""
    data = _jsonl(ctx.tmp / "data.jsonl", [_chat("What is 2 plus 2?"), _chat("7 " * 2_000_000)])
    return Case(_sft(ctx.good, ctx.tmp / "run", f"data.train={data}"),
                re.compile(re.escape(f"{data}: line 2 has 4000001 characters, more than data.max_tokens=128 tokens can "
                                     "hold (at most ") + r"\d+" + re.escape(" characters a token, the tokenizer's longest)")),
                [ctx.tmp / "run"])


def sft_empty_file(ctx):
    data = ctx.tmp / "data.jsonl"
    data.write_text("\n\n")
    return Case(_sft(ctx.good, ctx.tmp / "run", f"data.train={data}"), f"{data}: no samples", [ctx.tmp / "run"])


def rl_empty_sequence(ctx):
    data = _jsonl(ctx.tmp / "rollouts.jsonl", [_rollout([])])
    return Case(_rl(ctx.good, ctx.tmp / "run", data), f"{data}:1: needs at least 2 tokens, has 0", [ctx.tmp / "run"])


def rl_nan_logprob(ctx):
    row = _rollout([5, 6, 7, 8, 9, 10])
    row["rollout_logprobs"][4] = float("nan")
    data = _jsonl(ctx.tmp / "rollouts.jsonl", [row])
    return Case(_rl(ctx.good, ctx.tmp / "run", data), f"{data}:1: rollout_logprobs[4] is nan; log-probs must be "
                "finite and ≤ 0", [ctx.tmp / "run"])


def rl_reward_a_string(ctx):
    data = _jsonl(ctx.tmp / "rollouts.jsonl", [_rollout([5, 6, 7, 8]), _rollout([5, 6, 7, 8], reward="high")])
    return Case(_rl(ctx.good, ctx.tmp / "run", data), f"{data}:2: reward is 'high', not a number", [ctx.tmp / "run"])


def rl_tokens_a_string(ctx):
    row = _rollout([5, 6, 7, 8])
    row["tokens"] = "5 6 7 8"
    data = _jsonl(ctx.tmp / "rollouts.jsonl", [row])
    return Case(_rl(ctx.good, ctx.tmp / "run", data), f"{data}:1: tokens must be a list of numbers, got str",
                [ctx.tmp / "run"])


def rl_loss_mask_not_binary(ctx):
    row = _rollout([5, 6, 7, 8])
    row["loss_mask"][2] = 2
    data = _jsonl(ctx.tmp / "rollouts.jsonl", [row])
    return Case(_rl(ctx.good, ctx.tmp / "run", data), f"{data}:1: loss_mask[2] is 2; it must be 0 or 1",
                [ctx.tmp / "run"])


def replay_payload_wrong_shape(ctx):
    payload = base64.b64encode(torch.arange(7, dtype=torch.int32).numpy().tobytes()).decode()
    row = _rollout([5, 6, 7, 8, 9, 10], meta_info={"indexer_topk": payload, "prompt_tokens": 3, "completion_tokens": 3})
    data = _jsonl(ctx.tmp / "rollouts.jsonl", [row])
    return Case(_rl(ctx.good, ctx.tmp / "run", data),
                f"indexer replay: request '{data}:1': indexer_topk holds 7 int32, which fits neither 7 decoder layers "
                "nor 4 computing layers × (len(tokens) − 1 = 5) rows × index_topk 8", [ctx.tmp / "run"])


def replay_payload_kv_coordinates(ctx):
    """sglang 0.5.23's release sends KV-cache slots, not positions: refused, saying so."""
    tokens = [5, 6, 7, 8, 9, 10]
    slots = torch.tensor([40, 17, 3, 29, 11, 8])  # the KV slot of each position
    keys = torch.full((5, 7, 8), -1, dtype=torch.int32)
    for i in range(5):
        keys[i, :, : i + 1] = slots[: i + 1].to(torch.int32)
    payload = base64.b64encode(keys.numpy().tobytes()).decode()
    data = _jsonl(ctx.tmp / "rollouts.jsonl", [_rollout(tokens, meta_info={"indexer_topk": payload})])
    return Case(_rl(ctx.good, ctx.tmp / "run", data),
                f"indexer replay: request '{data}:1', model.layers.0: row 0 selects key 40, after its own position 0: "
                "this looks like KV-cache coordinates, not positions. sglang's 0.5.23 release returns KV-cache "
                "coordinates; R3 needs request-local positions, as the sglang build miles uses returns them "
                "(sglang PR 26684, see docs/replay.md)", [ctx.tmp / "run"])


def recipe_value_out_of_range(ctx):
    return Case(_sft(ctx.good, ctx.tmp / "run", "lora.dim=0"), "lora.dim must be at least 1, got 0 (key: lora.dim)",
                [ctx.tmp / "run"])


def resume_with_another_lora(ctx):
    """A run folder trained at one LoRA rank, resumed with another: refused, the run untouched."""
    run = _copy(ctx.fixture("run"), ctx.tmp / "run")
    return Case(_sft(ctx.good, run, "train.steps=3", "lora.dim=8"),
                re.compile(re.escape(f"{run}/checkpoints/step_0000002: trained with another LoRA configuration ") +
                           r"\(\{'dim': 4, .*\}, this recipe: \{'dim': 8, .*\}\); resume with the run's own recipe, "
                           r"or start a new train.output_dir"), unchanged=[run / "checkpoints", run / "recipe.yaml"])


def resume_with_another_base(ctx):
    """A resume from another base checkpoint (its config differs) is refused; the run is untouched."""
    run = _copy(ctx.fixture("run"), ctx.tmp / "run")
    other = _edit_config(ctx.broken("other"), routed_scaling_factor=3.5)
    return Case(_sft(other, run, "train.steps=3"),
                re.compile(re.escape(f"{run}/checkpoints/step_0000002: trained with another base model (") +
                           r"[0-9a-f]{16}, this recipe: [0-9a-f]{16}\); resume with the run's own recipe, or start a "
                           r"new train\.output_dir"), unchanged=[run / "checkpoints", run / "recipe.yaml"])


def sft_without_tokenizer(ctx):
    src = ctx.broken()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).unlink()
    return Case(_sft(src, ctx.tmp / "run"), f"{src}: no tokenizer (tokenizer.json / tokenizer_config.json); training "
                "tokenizes with the checkpoint's own tokenizer", [ctx.tmp / "run"])


def run_folder_in_use(ctx):
    """A second training into a folder another one holds (its lock) is refused before it starts."""
    import fcntl

    run = _copy(ctx.fixture("run"), ctx.tmp / "run")
    holder = open(run / ".lock", "a+")
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    holder.seek(0)
    holder.truncate()
    holder.write("4242\n")
    holder.flush()
    ctx.request.addfinalizer(holder.close)
    return Case(_sft(ctx.good, run, "train.steps=3"),
                f"{run}: another training is running in this folder (pid 4242)",
                unchanged=[run / "checkpoints", run / "recipe.yaml"])


def nan_in_base_weights(ctx):
    """NaN in a base weight is refused when the weights are loaded, before any step."""
    src = _edit_tensors(ctx.broken(), lambda t: t["model.layers.1.mlp.shared_experts.down_proj.weight"].fill_(float("nan")))
    return Case(_sft(src, ctx.tmp / "run"), re.compile(re.escape(f"{src}: non-finite weights: ") + r"\d+ NaN/Inf value\(s\) in "
                r"decoder\.layers\.1\.mlp\.shared_experts\.linear_fc2\.weight \(Megatron name; 1 tensor\(s\) in all\); "
                r"the checkpoint is corrupt"), [ctx.tmp / "run" / "checkpoints"])


def inf_in_base_weights_convert(ctx):
    """Inf in a base weight: convert refuses too, and writes nothing."""
    def poison(t):
        t["model.layers.0.self_attn.q_a_proj.weight"][0, :3] = float("inf")
    src = _edit_tensors(ctx.broken(), poison)
    return Case(["convert", str(src), str(ctx.tmp / "out")],
                f"{src}: non-finite weights: 3 NaN/Inf value(s) in decoder.layers.0.self_attention.linear_q_down_proj"
                ".weight (Megatron name; 1 tensor(s) in all); the checkpoint is corrupt", [ctx.tmp / "out"])


def diverging_learning_rate(ctx):
    """A learning rate that blows the adapters up after step 1: step 2's gradients are NaN, and the
    run stops before step 2's checkpoint."""
    run = ctx.tmp / "run"
    return Case(_sft(ctx.good, run, "train.lr=1e30", "train.warmup_steps=0", "train.save_every=1", "train.steps=3"),
                "step 2: grad_norm is nan; stopped before saving anything of this step (non-finite base weights, "
                "data or learning rate?)", [run / "checkpoints" / "step_0000002"])


def export_target_exists(ctx):
    dst = ctx.tmp / "merged"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    return Case(["export", str(ctx.fixture("run")), str(dst), "--merge"],
                f"{dst}: already exists (pass --overwrite / overwrite=True to replace it)", unchanged=[dst])


def _disk_full(target: Path) -> re.Pattern:
    return re.compile(re.escape(f"{target}: no space left on device (") + r"[0-9.]+ MiB free on /\S*\); nothing was written")


def export_disk_full(ctx):
    """The disk fills while the first safetensors shard is being written."""
    import safetensors.torch

    def full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 4096)  # part of the file made it to disk
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))

    run, dst = ctx.fixture("run"), ctx.tmp / "merged"
    ctx.monkeypatch.setattr(safetensors.torch, "save_file", full)
    return Case(["export", str(run), str(dst), "--merge"], _disk_full(dst), [dst])


def checkpoint_save_disk_full(ctx):
    """A resumed run hits a full disk while saving step 3: step 2 stays the latest checkpoint."""
    from megatron.core import dist_checkpointing

    run = _copy(ctx.fixture("run"), ctx.tmp / "run")

    def full(state, folder, *args, **kwargs):
        with open(Path(folder) / "__0_0.distcp", "wb") as out:
            out.write(b"\0" * 100)  # part of the shard made it to disk
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{folder}/__0_0.distcp")

    ctx.monkeypatch.setattr(dist_checkpointing, "save", full)
    argv = _sft(ctx.good, run, "train.steps=3", "train.save_every=1")
    return Case(argv, _disk_full(run / "checkpoints" / "step_0000003"), [run / "checkpoints" / "step_0000003"],
                unchanged=[run / "checkpoints"])


def trainer_checkpoint_pickle(ctx):
    """A trainer checkpoint that would run code when unpickled (here: os.system)."""
    run = _copy(ctx.fixture("run"), ctx.tmp / "run")

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {ctx.tmp}/pwned",)

    with open(run / "checkpoints" / "step_0000002" / ".metadata", "wb") as f:
        pickle.dump(Payload(), f)
    return Case(["export", str(run), str(ctx.tmp / "merged"), "--merge"],
                f"{run}/checkpoints/step_0000002/.metadata: refusing to unpickle posix.system (not a "
                "distributed-checkpoint metadata type)", [ctx.tmp / "merged", ctx.tmp / "pwned"])


def megatron_metadata_pickle(ctx):
    """A Megatron checkpoint whose distributed-checkpoint metadata would run code when unpickled."""
    mcore = _copy(ctx.fixture("megatron_checkpoint"), ctx.tmp / "mcore")

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {ctx.tmp}/pwned",)

    with open(mcore / "weights" / ".metadata", "wb") as f:
        pickle.dump(Payload(), f)
    return Case(["convert", str(mcore), str(ctx.tmp / "hf")],
                f"{mcore}/weights/.metadata: refusing to unpickle posix.system (not a distributed-checkpoint metadata "
                "type)", [ctx.tmp / "hf", ctx.tmp / "pwned"])


def megatron_extra_state_pickle(ctx):
    """A Megatron checkpoint whose non-tensor item (a layer's _extra_state) would run code when loaded."""
    mcore = _copy(ctx.fixture("megatron_checkpoint"), ctx.tmp / "mcore")
    with open(mcore / "weights" / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # written by this test's own conversion: trusted
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn.endswith("._extra_state/shard_0_1"))

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {ctx.tmp}/pwned",)

    payload = pickle.dumps(Payload(), protocol=2)
    assert len(payload) <= info.length
    with open(mcore / "weights" / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(payload.ljust(info.length, b"\0"))
    return Case(["convert", str(mcore), str(ctx.tmp / "hf")],
                f"{mcore}/weights: item {index.fqn} is unreadable (refused by the weights-only unpickler: Trying to "
                "load unsupported GLOBAL posix.system whose module posix is blocked.)",
                [ctx.tmp / "hf", ctx.tmp / "pwned"])


def megatron_weights_truncated(ctx):
    mcore = _copy(ctx.fixture("megatron_checkpoint"), ctx.tmp / "mcore")
    shard = sorted((mcore / "weights").glob("*.distcp"))[0]
    os.truncate(shard, shard.stat().st_size // 2)
    return Case(["convert", str(mcore), str(ctx.tmp / "hf")],
                re.compile(re.escape(f"{mcore}/weights: unreadable distributed checkpoint, truncated or corrupt (")
                           + r".+\)"),
                [ctx.tmp / "hf"])


def convert_target_exists(ctx):
    dst = ctx.tmp / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    return Case(["convert", str(ctx.good), str(dst)],
                f"{dst}: already exists (pass --overwrite / overwrite=True to replace it)", unchanged=[dst])


# Outputs that overlap inputs, or folders that are not ours (files.check_output).

def _reads(target: Path, how: str, source: Path) -> str:
    return f"{target}: {how} {source.resolve()}, which this command reads; choose another output folder"


def _not_ours(target: Path) -> str:
    return (f"{target}: not written by glm5-bridge (no .glm5-bridge-output), so it is neither replaced nor written "
            "into; remove it yourself or choose another folder")


def convert_onto_its_source(ctx):
    src = ctx.broken()
    return Case(["convert", str(src), str(src), "--overwrite"], _reads(src, "is", src), unchanged=[src])


def convert_over_the_folder_holding_its_source(ctx):
    src = ctx.broken()
    (ctx.tmp / "notes.txt").write_text("a sibling of the source")
    return Case(["convert", str(src), str(ctx.tmp), "--overwrite"], _reads(ctx.tmp, "contains", src),
                unchanged=[ctx.tmp])


def convert_into_its_source(ctx):
    src = ctx.broken()
    return Case(["convert", str(src), str(src / "mcore")], _reads(src / "mcore", "lies inside", src),
                absent=[src / "mcore"], unchanged=[src])


def convert_overwrite_of_a_foreign_folder(ctx):
    dst = ctx.tmp / "photos"
    dst.mkdir()
    (dst / "holiday.jpg").write_bytes(b"not ours")
    return Case(["convert", str(ctx.good), str(dst), "--overwrite"], _not_ours(dst), unchanged=[dst])


def export_onto_its_run(ctx):
    run = ctx.fixture("run")
    return Case(["export", str(run), str(run), "--merge", "--overwrite"], _reads(run, "is", run), unchanged=[run])


def export_overwrite_of_a_run_folder(ctx):
    run = ctx.fixture("run")
    other = ctx.tmp / "other_run"
    assert main(_sft(ctx.good, other, "train.steps=1")) == 0
    return Case(["export", str(run), str(other), "--merge", "--overwrite"],
                f"{other}: a glm5-bridge training run folder, not checkpoint or export folder; choose another folder",
                unchanged=[other, run])


def export_into_base_checkpoint(ctx):
    run = ctx.fixture("run")
    return Case(["export", str(run), str(ctx.good / "merged"), "--merge"],
                _reads(ctx.good / "merged", "lies inside", ctx.good), absent=[ctx.good / "merged"], unchanged=[run])


def train_export_dir_is_the_run(ctx):
    out = ctx.tmp / "run"
    argv = [a for a in _sft(ctx.good, out) if a != "export.kind=none"] + ["export.kind=merged", f"export.dir={out}"]
    return Case(argv, f"export.dir {out}: is the run folder {out}; choose another export folder", absent=[out])


def train_export_dir_foreign(ctx):
    dst = ctx.tmp / "results"
    dst.mkdir()
    (dst / "paper.tex").write_text("not ours")
    argv = [a for a in _sft(ctx.good, ctx.tmp / "run") if a != "export.kind=none"] + ["export.kind=merged",
                                                                                       f"export.dir={dst}"]
    return Case(argv, _not_ours(dst), absent=[ctx.tmp / "run"], unchanged=[dst])


def train_output_dir_foreign(ctx):
    out = ctx.tmp / "work"
    out.mkdir()
    (out / "recipe.yaml").write_text("someone else's file\n")
    return Case(_sft(ctx.good, out), _not_ours(out), unchanged=[out])


def train_output_dir_inside_base(ctx):
    src = ctx.broken()
    return Case(_sft(src, src / "run"), _reads(src / "run", "lies inside", src), absent=[src / "run"],
                unchanged=[src])


def make_tiny_over_a_checkpoint(ctx):
    """A checkpoint from elsewhere (no marker: not written by glm5-bridge) is never replaced."""
    src = ctx.broken()
    (src / ".glm5-bridge-output").unlink()
    return Case(["make-tiny", "GLM-5.2", str(src), "--overwrite"], _not_ours(src), unchanged=[src])


def config_index_topk_zero(ctx):
    src = _edit_config(ctx.broken(), index_topk=0)
    return Case(["convert", str(src), str(ctx.tmp / "out")],
                f"{src}/config.json: index_topk is 0, expected a whole number >= 1", [ctx.tmp / "out"])


def config_short_indexer_types(ctx):
    src = ctx.broken()
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    _edit_config(src, indexer_types=["full"])
    return Case(["convert", str(src), str(ctx.tmp / "out")],
                f"{src}/config.json: indexer_types has 1 entries, num_hidden_layers is {layers}", [ctx.tmp / "out"])


def config_more_experts_per_token_than_experts(ctx):
    src = ctx.broken()
    experts = json.loads((src / "config.json").read_text())["n_routed_experts"]
    _edit_config(src, num_experts_per_tok=experts + 1)
    return Case(["convert", str(src), str(ctx.tmp / "out")],
                f"{src}/config.json: num_experts_per_tok {experts + 1} exceeds n_routed_experts {experts}",
                [ctx.tmp / "out"])


def plan_with_zero_tensor_parallel(ctx):
    return Case(["plan", "GLM-5.2", "--tp", "0"], "argument --tp: 0 is below 1")


def plan_with_negative_sequence(ctx):
    return Case(["plan", "GLM-5.2", "--seq-len", "-4096"], "argument --seq-len: -4096 is below 1")


CASES = [wrong_model_type, wrong_architecture, missing_config, config_not_json, config_rejected_by_transformers,
         missing_shard, truncated_safetensors,
         missing_tensor, extra_tensor, renamed_tensor, wrong_shape, config_disagrees_with_weights, wrong_dtype,
         integer_tensor, pickle_weights_only, unknown_preset, unknown_source, preset_without_weights,
         recipe_typo_override, recipe_typo_in_file, recipe_wrong_type, recipe_section_not_a_mapping, recipe_not_yaml,
         missing_dataset, dataset_not_json, sft_token_id_beyond_vocab, rl_token_id_beyond_vocab, sft_empty_sample,
         sft_line_too_long, sft_empty_file, rl_empty_sequence, replay_payload_wrong_shape, replay_payload_kv_coordinates,
         rl_nan_logprob, rl_reward_a_string, rl_tokens_a_string, rl_loss_mask_not_binary, recipe_value_out_of_range,
         resume_with_another_lora, resume_with_another_base, sft_without_tokenizer, run_folder_in_use,
         nan_in_base_weights, inf_in_base_weights_convert, diverging_learning_rate, export_target_exists,
         export_disk_full,
         checkpoint_save_disk_full, trainer_checkpoint_pickle, megatron_metadata_pickle, megatron_extra_state_pickle,
         megatron_weights_truncated,
         convert_target_exists, convert_onto_its_source, convert_over_the_folder_holding_its_source,
         convert_into_its_source, convert_overwrite_of_a_foreign_folder, export_onto_its_run,
         export_overwrite_of_a_run_folder, export_into_base_checkpoint, train_export_dir_is_the_run,
         train_export_dir_foreign, train_output_dir_foreign, train_output_dir_inside_base, make_tiny_over_a_checkpoint,
         plan_with_zero_tensor_parallel, plan_with_negative_sequence, config_index_topk_zero,
         config_short_indexer_types, config_more_experts_per_token_than_experts]
CASE_IDS = [c.__name__.replace("_", "-") for c in CASES]
PASSED: dict[str, str] = {}


@pytest.mark.parametrize("make", CASES, ids=CASE_IDS)
def test_bad_input(make, source, tmp_path, request, monkeypatch, capsys):
    ctx = Ctx(tmp_path, source[0], request, monkeypatch)
    case = make(ctx)
    before = {p: _hashes(p) for p in case.unchanged}
    capsys.readouterr()
    try:
        status = main(case.argv)
    except SystemExit as e:  # argparse refuses an argument
        status = e.code
    err = capsys.readouterr().err
    monkeypatch.undo()
    PASSED[make.__name__] = _check(case, status, err, before, source)


# One case of each class run as its own `python -m glm5_bridge.cli` process (each costs ~10 s of
# imports, so not all of them; they run side by side): no upstream warning or log line may reach
# stderr before ours.
REAL_PROCESS = [missing_tensor, convert_onto_its_source, resume_with_another_lora, nan_in_base_weights,
                plan_with_zero_tensor_parallel, sft_line_too_long]


def _concurrently(commands: list[list[str]], folder: Path) -> list[tuple[int, str, str]]:
    """Run the commands side by side (output to files: no pipe can fill); (status, stdout, stderr) each."""
    procs = []
    for i, argv in enumerate(commands):
        out, err = open(folder / f"{i}.out", "w"), open(folder / f"{i}.err", "w")
        procs.append((subprocess.Popen(argv, stdout=out, stderr=err, text=True, cwd=ROOT), out, err))
    results = []
    for proc, out, err in procs:
        status = proc.wait()
        out.close(), err.close()
        results.append((status, Path(out.name).read_text(), Path(err.name).read_text()))
    return results


def test_one_case_of_each_class_as_a_real_process(source, tmp_path, request, monkeypatch):
    cases = []
    for make in REAL_PROCESS:
        (tmp_path / make.__name__).mkdir()
        case = make(Ctx(tmp_path / make.__name__, source[0], request, monkeypatch))
        cases.append((make.__name__, case, {p: _hashes(p) for p in case.unchanged}))
    results = _concurrently([[sys.executable, "-m", "glm5_bridge.cli", *case.argv] for _, case, _ in cases], tmp_path)
    for (name, case, before), (status, _, err) in zip(cases, results):
        try:
            _check(case, status, err, before, source)
            assert len(err.strip().splitlines()) == 1, err[-3000:]
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def _check(case: Case, status: int, err: str, before: dict, source) -> str:
    """Exit 2, one `glm5-bridge CMD: error: ...` line last and no other of ours, no traceback,
    nothing left or changed; returns the message."""
    prefix = f"glm5-bridge {case.argv[0]}: error: "
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert [line for line in lines if line.startswith("glm5-bridge ")] == lines[-1:], err[-3000:]
    message = lines[-1][len(prefix):] if lines[-1].startswith(prefix) else lines[-1]
    if isinstance(case.message, re.Pattern):
        assert lines[-1].startswith(prefix) and case.message.fullmatch(message), lines[-1]
    else:
        assert lines[-1] == prefix + case.message
    for path in case.absent:
        assert not path.exists(), f"{path} was left behind"
    for path in case.unchanged:
        assert _hashes(path) == before[path], f"{path} changed"
    for folder in {p.parent for p in case.absent + case.unchanged} | {p for p in case.unchanged}:
        assert _leftovers(folder) == [], f"temporary files left in {folder}"
    assert _hashes(source[0]) == source[1], "the shared source checkpoint changed"
    return message


def test_zz_record_bad_inputs():
    """All cases passed in this session: record what was tried for the README (tests/checked.json)."""
    if set(PASSED) != {c.__name__ for c in CASES}:
        pytest.skip("not every bad-input case ran and passed in this session")
    _checked.record("bad_input", {"count": len(CASES), "cases": [i for i in CASE_IDS],
                                  "test": "tests/test_bad_input.py"})
    assert _checked.load()["bad_input"]["count"] == len(CASES)


# ------------------------------------------------------------------- the validator accepts valid input

@pytest.mark.parametrize("variant", ["GLM-5", "GLM-5.1", "GLM-5.2"])
def test_every_tiny_variant_passes(tiny_checkpoint, variant):
    config = validate_checkpoint(tiny_checkpoint(variant))
    assert config["model_type"] == "glm_moe_dsa"


def test_sharded_checkpoint_passes_and_errors_name_the_shard(source, tmp_path):
    src = _copy(source[0], tmp_path / "hf")
    first, second = _shard(src)
    validate_checkpoint(src)
    _edit = load_file(src / "model-00002-of-00002.safetensors")
    _edit[second[0]] = _edit[second[0]][..., :1].clone()
    save_file(_edit, src / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(f"{src}/model-00002-of-00002.safetensors: tensor {second[0]} "
                                                        "has shape")):
        validate_checkpoint(src)


def test_our_merged_export_passes(run, tmp_path):
    assert main(["export", str(run), str(tmp_path / "merged"), "--merge"]) == 0
    validate_checkpoint(tmp_path / "merged")
    # --overwrite replaces an existing target (by rename; nothing left beside it).
    (tmp_path / "merged" / "stale.txt").write_text("old")
    assert main(["export", str(run), str(tmp_path / "merged"), "--merge", "--overwrite"]) == 0
    assert not (tmp_path / "merged" / "stale.txt").exists() and _leftovers(tmp_path) == []
    validate_checkpoint(tmp_path / "merged")


@pytest.mark.parametrize("preset", ["GLM-5", "GLM-5.1", "GLM-5.2"])
def test_presets_imply_the_published_parameter_count(preset):
    """The tensors the validator expects for the real configs hold exactly plan.py's parameter count."""
    from glm5_bridge.model.config import load_hf_config, load_preset_dict
    from glm5_bridge.train.plan import count_parameters

    required, optional = expected_tensors(load_preset_dict(preset))
    assert sum(math.prod(s) for s in required.values()) == count_parameters(load_hf_config(preset))["total"]
    assert set(optional) == {"model.layers.78.embed_tokens.weight", "model.layers.78.shared_head.head.weight"}


def test_header_reader_reads_only_the_header(source):
    header = read_header(source[0] / SHARD)
    ref = load_file(source[0] / SHARD)
    assert {k: (v[0], v[1]) for k, v in header.items()} == {k: ("F32", tuple(t.shape)) for k, t in ref.items()}


def test_topk_beyond_every_sequence_is_warned(source, tmp_path):
    """index_topk larger than every sample: the run goes on, with a warning naming the cost."""
    src = _edit_config(_copy(source[0], tmp_path / "hf"), index_topk=4096)
    with pytest.warns(UserWarning, match=r"config\.json: index_topk=4096 exceeds the longest sample \(\d+ tokens\): "
                                         r"every query attends to all its keys and still pays for 4096 slots"):
        assert main(_sft(src, tmp_path / "run", "train.steps=1")) == 0


def _can_mount_tmpfs(tmp: Path) -> bool:
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {tmp}"],
                           capture_output=True)
    return probe.returncode == 0


def test_a_real_full_disk(source, run, megatron_checkpoint, tmp_path):
    """A real full disk, not a simulated OSError: each command's output goes to a small tmpfs (its own
    mount namespace, `unshare -m`; root only) and safetensors, torch and dist_checkpointing raise what
    they really raise. Each exits 2 with one line naming its target; its tmpfs is empty after.
    The five run side by side."""
    if not _can_mount_tmpfs(tmp_path):
        pytest.skip("cannot mount a tmpfs in a private mount namespace here (needs root and unshare)")
    disks = {name: tmp_path / name for name in ("make-tiny", "convert-to-megatron", "convert-to-hf", "export", "train")}
    for disk in disks.values():
        disk.mkdir()
    jobs = {  # command: (target, argv, tmpfs size)
        "make-tiny": (disks["make-tiny"] / "tiny", ["make-tiny", "GLM-5.2", str(disks["make-tiny"] / "tiny")], "1m"),
        "convert-to-megatron": (disks["convert-to-megatron"] / "mcore",
                                ["convert", str(source[0]), str(disks["convert-to-megatron"] / "mcore")], "1m"),
        "convert-to-hf": (disks["convert-to-hf"] / "hf",
                          ["convert", str(megatron_checkpoint), str(disks["convert-to-hf"] / "hf")], "1m"),
        "export": (disks["export"] / "merged", ["export", str(run), str(disks["export"] / "merged"), "--merge"], "1m"),
        # the run folder starts (recipe, lock, TensorBoard) and the first checkpoint does not fit
        "train": (disks["train"] / "run" / "checkpoints" / "step_0000001",
                  _sft(source[0], disks["train"] / "run", "train.save_every=1"), "512k"),
    }
    # stdout: the exit status and what is left on the tmpfs; stderr: the command's
    scripts = [["unshare", "-m", "sh", "-c",
                f"exec 3>&1 1>&2; mount -t tmpfs -o size={size} tmpfs {disks[name]} && {sys.executable} -m "
                "glm5_bridge.cli " + " ".join(f"'{a}'" for a in argv) + f" > /dev/null; echo rc=$? >&3; "
                f"ls -A {disks[name]} >&3"] for name, (_, argv, size) in jobs.items()]
    logs = tmp_path / "logs"
    logs.mkdir()
    for (name, (target, argv, _)), (_, out, err) in zip(jobs.items(), _concurrently(scripts, logs)):
        report, lines = out.split(), err.strip().splitlines()
        assert report[0] == "rc=2" and "Traceback" not in err, (name, err[-3000:])
        assert _disk_full(target).fullmatch(lines[-1][len(f"glm5-bridge {argv[0]}: error: "):]), (name, lines[-1])
        assert lines == lines[-1:], f"{name}: stderr is one line"
        assert report[1:] == [], f"{name}: left on the full disk: {report[1:]}"
    assert _hashes(source[0]) == source[1]


# ---------------------------------------------------------------- the source is only read; no pickle

_AUDIT = {"on": False, "globals": []}


def _audit(event, args):
    if event == "pickle.find_class" and _AUDIT["on"]:
        frames, f = [], sys._getframe(1)
        while f is not None:
            frames.append(f"{f.f_code.co_filename}:{f.f_code.co_name}")
            f = f.f_back
        _AUDIT["globals"].append((args, tuple(frames)))


sys.addaudithook(_audit)


def test_source_only_read_and_no_arbitrary_unpickling(source, run, megatron_checkpoint, tmp_path):
    """convert HF → Megatron → HF, resume training, export: the source checkpoint's bytes and mtimes
    are unchanged, and every global any pickle load resolved along the way is on the
    distributed-checkpoint metadata allowlist (trainer checkpoints load with weights_only=True,
    which resolves none through pickle)."""
    from glm5_bridge.files import _METADATA_GLOBALS

    path, hashes = source
    work = _copy(run, tmp_path / "run")
    _AUDIT.update(on=True, globals=[])
    try:
        assert main(["convert", str(path), str(tmp_path / "mcore")]) == 0
        assert main(["convert", str(megatron_checkpoint), str(tmp_path / "hf")]) == 0
        assert main(_sft(path, work, "train.steps=3", "train.save_every=1")) == 0  # resumes at step 2
        assert main(["export", str(work), str(tmp_path / "adapter"), "--adapter"]) == 0
    finally:
        _AUDIT["on"] = False
    assert _hashes(path) == hashes
    assert json.loads((work / "history.json").read_text())[-1]["step"] == 3
    # Not files we read: torch.compile's caches (dynamo / inductor / functorch) pickle in-memory graphs,
    # object collectives (gather_object, ...) and multiprocessing queues pickle what processes exchange.
    compiler = ("/torch/_dynamo/", "/torch/_inductor/", "/torch/_functorch/",
                "/torch/distributed/distributed_c10d.py:_tensor_to_object", "/multiprocessing/connection.py:recv",
                "/multiprocessing/queues.py:get")
    resolved = {g: frames for g, frames in _AUDIT["globals"]
                if not any(part in frame for frame in frames for part in compiler)}
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in resolved, "metadata read, restricted"
    outside = {g: frames[:8] for g, frames in resolved.items() if g[1] not in _METADATA_GLOBALS.get(g[0], ())
               and not (g[0] == "torch" and isinstance(getattr(torch, g[1], None), torch.dtype))}
    assert outside == {}


def test_package_never_unpickles_freely():
    """No torch.load without weights_only=True, no pickle.load(s) in the package."""
    offenders = []
    for file in sorted((ROOT / "glm5_bridge").rglob("*.py")):
        text = file.read_text()
        for m in re.finditer(r"torch\.load\(([^()]|\([^()]*\))*\)", text):
            if "weights_only=True" not in m.group(0):
                offenders.append(f"{file.name}: {m.group(0)}")
        offenders += [f"{file.name}: {m.group(0)}" for m in re.finditer(r"pickle\.loads?\(|weights_only=False|"
                                                                          r"allow_pickle=True", text)]
    assert offenders == []


# ------------------------------------------------------------------- what a killed writer leaves behind

def test_abandoned_temporaries_are_removed_live_ones_kept(tmp_path):
    from glm5_bridge.files import remove_abandoned

    dead = subprocess.Popen(["true"])
    dead.wait()
    abandoned = [f".step_0000004.tmp-{dead.pid}", f".latest.tmp-{dead.pid}", f".merged.tmp-{dead.pid}-0a1b2c3d",
                 f".merged.old-{dead.pid}-0a1b2c3d"]
    kept = [f".step_0000006.tmp-{os.getpid()}", ".hidden", "notes.tmp-1", "step_0000002"]
    for name in abandoned + kept:
        if "latest" in name or name == "notes.tmp-1":
            (tmp_path / name).write_text("x")
        else:
            (tmp_path / name).mkdir()
            (tmp_path / name / "state.pt").write_bytes(b"half")
    assert remove_abandoned(tmp_path, "merged") == sorted(abandoned[2:])
    assert remove_abandoned(tmp_path) == sorted(abandoned[:2])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


def test_atomic_write_keeps_the_old_content_on_failure(tmp_path, monkeypatch):
    from glm5_bridge.files import atomic_write_text

    atomic_write_text(tmp_path / "latest", "step_0000002")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        atomic_write_text(tmp_path / "latest", "step_0000004")
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == "step_0000002" and sorted(os.listdir(tmp_path)) == ["latest"]
