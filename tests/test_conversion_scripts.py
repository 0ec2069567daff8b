"""conversion/*.py (Megatron-Bridge's examples/conversion form) run as scripts on a tiny checkpoint.

Each script is its own process (~10 s of imports), so the four runs go two at a time, once per module."""

import importlib.util
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "conversion"


def run(script, *args):
    """(exit status, stdout, stderr) of `python conversion/<script> args...` from the repo root."""
    done = subprocess.run([sys.executable, str(SCRIPTS / script), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr


def roundtrip_module():
    spec = importlib.util.spec_from_file_location("roundtrip_check", SCRIPTS / "roundtrip_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tmp_path_factory):
    """(source, work folder, {script: (rc, stdout, stderr)})"""
    src, tmp = tiny_checkpoint("GLM-5.2"), tmp_path_factory.mktemp("conversion_scripts")

    def both_ways():
        first = run("hf_to_megatron.py", src, tmp / "mcore")
        return {"hf_to_megatron": first, "megatron_to_hf": run("megatron_to_hf.py", tmp / "mcore", tmp / "back")}

    def checks():
        return {"roundtrip_check": run("roundtrip_check.py", src),
                "compare_logits": run("compare_logits.py", src, "--seq-len", 16, "--batch", 1)}

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(both_ways), pool.submit(checks)]
        results = {k: v for f in futures for k, v in f.result().items()}
    return src, tmp, results


def test_hf_to_megatron_and_back(runs):
    src, tmp, results = runs
    rc, out, err = results["hf_to_megatron"]
    assert rc == 0, err
    assert f"Megatron distributed checkpoint written to {tmp / 'mcore'}" in out
    assert (tmp / "mcore" / "weights").is_dir() and (tmp / "mcore" / "glm5_bridge.json").is_file()
    rc, out, err = results["megatron_to_hf"]
    assert rc == 0, err
    assert f"HF checkpoint written to {tmp / 'back'}" in out
    count, mismatches = roundtrip_module().compare_checkpoints(src, tmp / "back")
    assert count > 100 and mismatches == []


def test_roundtrip_check_passes(runs):
    rc, out, err = runs[2]["roundtrip_check"]
    assert rc == 0, err
    assert "tensors compared: all equal bit for bit" in out


def test_compare_logits(runs):
    rc, out, err = runs[2]["compare_logits"]
    assert rc == 0, err
    assert "max |logits(Megatron) - logits(transformers)| = " in out and out.rstrip().endswith(": OK")


def test_roundtrip_check_names_a_changed_tensor(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("GLM-5.2")
    changed = tmp_path / "changed"
    shutil.copytree(src, changed)
    (shard,) = changed.glob("*.safetensors")
    tensors = load_file(shard)
    name = "model.layers.0.self_attn.q_b_proj.weight"
    flat = tensors[name].clone().view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))  # one ulp up
    tensors[name] = flat.view_as(tensors[name])
    save_file(tensors, shard, metadata={"format": "pt"})

    rc, out, err = run("roundtrip_check.py", "--compare", src, changed)
    assert rc == 1, err
    assert "1 mismatch(es)" in out and f"MISMATCH {name}: values differ" in out

    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    count, mismatches = roundtrip_module().compare_checkpoints(src, changed)
    assert mismatches == [f"{name}: only in {src}"] and count == len(tensors)
