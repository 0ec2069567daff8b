"""Recipes load and validate; LoRA SFT on the tiny model learns, and resumes exactly."""

from pathlib import Path

import pytest

from glm5_bridge.train.recipe import load_recipe

RECIPES = sorted(Path(__file__).resolve().parents[1].joinpath("recipes").glob("*.yaml"))


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
