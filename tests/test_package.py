"""The package installs like one: a built wheel carries the presets, the embedded data and the
recipes, installs into a fresh environment with the locked dependencies (uv.lock, the overrides of
pyproject.toml applied by the lock), and its `glm5-bridge` runs there — `--version`, and the demo
from outside the source tree, finding its recipe and data inside the installed package."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _uv() -> str:
    found = shutil.which("uv") or str(ROOT / ".tools" / "uv" / "bin" / "uv")
    if not Path(found).exists():
        pytest.skip("uv is not installed (scripts/setup.sh installs it)")
    return found


def _run(*cmd, cwd=ROOT, timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env["UV_PYTHON_DOWNLOADS"] = "never"
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (cmd, proc.stdout[-2000:], proc.stderr[-3000:])
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    _run(_uv(), "build", "--wheel", "--out-dir", out)
    (found,) = out.glob("glm5_bridge-*.whl")
    return found


def test_wheel_carries_data_recipes_and_entry_point(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("glm5_bridge/recipes/tiny_lora_sft.yaml", "glm5_bridge/recipes/base/lora_sft.yaml",
                   "glm5_bridge/recipes/glm52_lora_rl.yaml", "glm5_bridge/train/data/arithmetic.jsonl",
                   "glm5_bridge/train/data/majority.jsonl",
                   "glm5_bridge/model/presets/GLM-5.2.json", "glm5_bridge/kernels/sparse_mla_fwd.py"):
        assert needed in names, needed
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "glm5-bridge = glm5_bridge.cli:entry" in zipfile.ZipFile(wheel).read(entry).decode()
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


def test_installed_wheel_runs_the_demo_outside_the_tree(wheel, tmp_path):
    uv, venv = _uv(), tmp_path / "venv"
    _run(uv, "venv", venv, "--python", sys.executable)
    locked = tmp_path / "locked.txt"
    locked.write_text(_run(uv, "export", "--frozen", "--no-dev", "--no-emit-project", "--no-hashes",
                           "--format", "requirements-txt").stdout)
    _run(uv, "pip", "install", "--python", venv / "bin" / "python", "-r", locked, "--quiet")
    _run(uv, "pip", "install", "--python", venv / "bin" / "python", "--no-deps", wheel, "--quiet")
    work = tmp_path / "elsewhere"
    work.mkdir()
    version = _run(venv / "bin" / "glm5-bridge", "--version", cwd=work).stdout
    assert version.strip() == "glm5-bridge 0.1.0"
    demo = _run(venv / "bin" / "glm5-bridge", "demo", "--workdir", work / "demo", cwd=work)
    assert "DEMO OK" in demo.stdout
    assert not (work / "glm5_bridge").exists()
    check_demo_outputs(work / "demo")


def check_demo_outputs(workdir: Path) -> None:
    """The README's main job (glm5-bridge demo, run above from the installed wheel): every stage ran
    and its checks hold."""
    import json

    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["heldout_exact_match_before"] <= 0.1 and summary["heldout_exact_match_after"] >= 0.8
    assert summary["convert_logits_max_abs_diff"] <= 1e-5
    assert summary["convert_tensors_bit_identical"] == "310/310"
    assert summary["export_logits_max_abs_diff"] <= 5e-5  # fp32 reordering, see demo.py
    assert summary["sft_loss_last"] < summary["sft_loss_first"]
    assert len(summary["answers"]) == 5 and (workdir / "sft" / "loss.png").is_file()
    # the merged export carries its model card: base, LoRA, final metrics, recipe
    (card,) = (workdir / "sft").glob("export_*/README.md")
    text = card.read_text()
    assert f'base_model: "{(workdir / "hf").resolve()}"' in text and "library_name: transformers" in text
    assert "- LoRA: dim 16, alpha 32" in text and "- After step 60: loss " in text and "## Recipe" in text
