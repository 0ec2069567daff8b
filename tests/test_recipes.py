"""Recipes load and validate; LoRA SFT on the tiny model learns, and resumes exactly."""

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from glm5_bridge.train.recipe import Recipe, load_recipe, to_yaml

RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"
RECIPES = sorted(RECIPE_DIR.glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_recipe_loads(path):
    recipe = load_recipe(path)
    assert recipe.train.steps > 0 and recipe.lora.dim > 0


def test_overrides_apply():
    recipe = load_recipe(RECIPES[0], ["train.steps=7", "lora.dim=4", "model.dsa_attention_backend=tilelang"])
    assert (recipe.train.steps, recipe.lora.dim, recipe.model.dsa_attention_backend) == (7, 4, "tilelang")


def test_typo_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"train\.stpes"):
        load_recipe(RECIPES[0], ["train.stpes=7"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("lora:\n  rank: 8\n")
    with pytest.raises(ValueError, match=r"bad.yaml.*lora\.rank"):
        load_recipe(bad)
    with pytest.raises(ValueError, match=r"train\.steps"):
        load_recipe(RECIPES[0], ["train.steps=many"])


# What the GLM-5.x recipes hold, written out (recipes/base/ + two lines per model); they must load
# to exactly this (schema defaults for everything not named).
_BIG = {"model": {"dsa_attention_backend": "tilelang", "tensor_model_parallel_size": 8,
                  "pipeline_model_parallel_size": 4, "pipeline_stage_layers": [18, 20, 20, 20],
                  "expert_model_parallel_size": 8, "bf16": True},
        "lora": {"dim": 64, "alpha": 128}, "export": {"kind": "adapter"}, "train": {"global_batch_size": 8}}
BEFORE_SPLIT = {
    "sft": OmegaConf.merge(_BIG, {"task": "sft", "data": {"train": "/path/to/chat.jsonl", "max_tokens": 16384},
                                  "train": {"steps": 1000, "lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 50,
                                            "save_every": 100}}),
    "rl": OmegaConf.merge(_BIG, {"task": "rl", "data": {"train": "/path/to/rollouts.jsonl", "max_tokens": 16384},
                                 "train": {"steps": 200, "lr": 1e-5, "save_every": 20},
                                 "rl": {"clip_eps": 0.2, "kl_coef": 0.001, "replay": True}}),
}
MODELS = {"glm5": "GLM-5", "glm51": "GLM-5.1", "glm52": "GLM-5.2"}


def _flat(config, prefix=""):
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize("task", ["sft", "rl"])
@pytest.mark.parametrize("stem", MODELS)
def test_model_recipes_are_their_base_plus_checkpoint_and_output(stem, task):
    path = RECIPE_DIR / f"{stem}_lora_{task}.yaml"
    own = {"model": {"checkpoint": f"/path/to/{MODELS[stem]}"}, "train": {"output_dir": f"runs/{stem}_lora_{task}"}}
    expected = OmegaConf.merge(OmegaConf.structured(Recipe), BEFORE_SPLIT[task], own)
    assert to_yaml(load_recipe(path)) == OmegaConf.to_yaml(expected)
    # The file holds only its base and those two values; everything else is the base's.
    assert sorted(_flat(OmegaConf.to_container(OmegaConf.load(path)))) == ["base", "model.checkpoint",
                                                                          "train.output_dir"]
    loaded = _flat(OmegaConf.to_container(OmegaConf.structured(load_recipe(path))))
    base = _flat(OmegaConf.to_container(OmegaConf.structured(load_recipe(RECIPE_DIR / "base" / f"lora_{task}.yaml"))))
    assert {k for k in loaded if loaded[k] != base[k]} == {"model.checkpoint", "train.output_dir"}


def test_base_chain_merges_in_order(tmp_path):
    (tmp_path / "bases").mkdir()
    (tmp_path / "bases" / "root.yaml").write_text("lora:\n  dim: 4\n  alpha: 8\ntrain:\n  steps: 3\n")
    (tmp_path / "bases" / "mid.yaml").write_text("base: root.yaml\nlora:\n  dim: 6\n")
    (tmp_path / "run.yaml").write_text("base: bases/mid.yaml\ntrain:\n  steps: 5\n")
    recipe = load_recipe(tmp_path / "run.yaml", ["lora.alpha=9"])  # recipe over bases, overrides over all
    assert (recipe.lora.dim, recipe.lora.alpha, recipe.train.steps) == (6, 9, 5)
    (tmp_path / "bases" / "root.yaml").write_text("lora:\n  rnak: 4\n")  # a typo in a base names the base
    with pytest.raises(ValueError, match=r"root\.yaml: .*lora\.rnak"):
        load_recipe(tmp_path / "run.yaml")


def test_missing_or_cyclic_base_is_one_line_naming_it(tmp_path):
    recipe = tmp_path / "run.yaml"
    recipe.write_text("base: base/nowhere.yaml\ntrain:\n  steps: 5\n")
    with pytest.raises(ValueError) as e:
        load_recipe(recipe)
    assert str(e.value) == f"{recipe}: base recipe {tmp_path / 'base' / 'nowhere.yaml'} not found (key: base)"
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    recipe.write_text("base: a.yaml\n")
    with pytest.raises(ValueError) as e:
        load_recipe(recipe)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'b.yaml'}: base recipes form a cycle")
    assert f"{tmp_path / 'a.yaml'})" in message


def _tiny_sft(checkpoint, out, **extra):
    overrides = [f"model.checkpoint={checkpoint}", f"train.output_dir={out}", "data.limit=300",
                 "data.max_tokens=256", "lora.dim=8", "train.lr=3e-3", "export.kind=none",
                 "train.deterministic=true"]
    return load_recipe(None, overrides + [f"{k}={v}" for k, v in extra.items()])


def test_sft_lowers_the_loss(tiny_checkpoint, tmp_path):
    from glm5_bridge.train.sft import train_sft

    result = train_sft(_tiny_sft(tiny_checkpoint("GLM-5.2"), tmp_path / "run", **{"train.steps": 30}))
    losses = [h["loss"] for h in result["history"]]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.75 * first, (first, last)
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000
    # Only the adapters moved: every base weight equals the checkpoint's.
    from glm5_bridge.testing import load_megatron

    base = dict(load_megatron(tiny_checkpoint("GLM-5.2"))[1].named_parameters())
    trained = dict(result["model"].named_parameters())
    for name, p in trained.items():
        if ".adapter." not in name:
            plain = name.replace(".to_wrap.", ".")
            assert (p.detach() == base[plain].detach()).all(), name


def test_resume_reproduces_the_uninterrupted_run_exactly(tiny_checkpoint, tmp_path):
    from glm5_bridge.train.sft import train_sft

    ckpt = tiny_checkpoint("GLM-5.2")
    straight = train_sft(_tiny_sft(ckpt, tmp_path / "a", **{"train.steps": 12, "train.save_every": 4}))
    interrupted = _tiny_sft(ckpt, tmp_path / "b", **{"train.steps": 12, "train.save_every": 4})
    train_sft(interrupted, stop_after=6)  # dies after step 6; last checkpoint is step 4
    resumed = train_sft(interrupted)
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in straight["history"]]
    a = {k: v for k, v in straight["model"].named_parameters() if ".adapter." in k}
    b = {k: v for k, v in resumed["model"].named_parameters() if ".adapter." in k}
    assert all((a[k] == b[k]).all() for k in a)


HARDWARE = re.compile(r"^# Hardware: (\d+) × (\w+) ", re.M)


@pytest.mark.parametrize("task", ["sft", "rl"])
@pytest.mark.parametrize("stem", MODELS)
def test_shipped_recipe_fits_its_named_hardware(stem, task):
    """The GPUs a GLM-5.x recipe names in its header hold its layout by `plan`'s memory model, and
    the layout divides them: TP × PP × DP GPUs, the global batch over DP, EP within TP × DP."""
    from glm5_bridge.model.config import check_stage_starts, indexer_types, load_hf_config
    from glm5_bridge.train.plan import GPU_MEMORY_GIB, recipe_plan, verdict

    path = RECIPE_DIR / f"{stem}_lora_{task}.yaml"
    count, gpu = HARDWARE.search(path.read_text()).groups()
    recipe = load_recipe(path)
    m, hf = recipe.model, load_hf_config(MODELS[stem])
    fits, line = verdict(hf, recipe_plan(recipe), GPU_MEMORY_GIB[gpu])
    assert fits, line
    dp, rest = divmod(int(count), m.tensor_model_parallel_size * m.pipeline_model_parallel_size)
    assert rest == 0 and dp >= 1 and recipe.train.global_batch_size % dp == 0
    assert (m.tensor_model_parallel_size * dp) % m.expert_model_parallel_size == 0
    stages = m.pipeline_stage_layers
    check_stage_starts(indexer_types(hf), [sum(stages[:i]) for i in range(len(stages))])
    assert len(set(stages[1:-1])) <= 1  # megatron splits the middle stages evenly
