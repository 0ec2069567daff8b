"""`glm5-bridge` CLI: conversion both ways through a Megatron distributed checkpoint, refusals."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from glm5_bridge.cli import main


def test_convert_hf_megatron_hf_round_trip(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("GLM-5.2")
    assert main(["convert", str(src), str(tmp_path / "mcore")]) == 0
    assert (tmp_path / "mcore" / "weights").is_dir() and (tmp_path / "mcore" / "hf" / "config.json").is_file()
    assert main(["convert", str(tmp_path / "mcore"), str(tmp_path / "back")]) == 0
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "back" / "tokenizer.json").is_file()
    assert not list(tmp_path.glob(".*tmp-*")), "no temporary folder left behind"


def test_convert_refuses_existing_target(tiny_checkpoint, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    source = tiny_checkpoint("GLM-5")
    capsys.readouterr()  # making the checkpoint may print progress bars
    assert main(["convert", str(source), str(tmp_path / "taken")]) == 2
    err = capsys.readouterr().err.strip()
    assert "already exists" in err and str(tmp_path / "taken") in err and "\n" not in err
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]


def test_overwrite_replaces_only_our_outputs(tiny_checkpoint, tmp_path):
    """An empty folder is as good as none; --overwrite replaces a folder glm5-bridge wrote (it
    carries the marker) and nothing else (files.check_output)."""
    from glm5_bridge.files import OUTPUT_MARKER, output_kind

    (tmp_path / "empty").mkdir()
    assert main(["make-tiny", "GLM-5.2", str(tmp_path / "empty")]) == 0
    assert output_kind(tmp_path / "empty") == "output"
    first = load_file(tmp_path / "empty" / "model.safetensors")
    assert main(["make-tiny", "GLM-5.2", str(tmp_path / "empty"), "--seed", "1", "--overwrite"]) == 0
    second = load_file(tmp_path / "empty" / "model.safetensors")
    assert set(first) == set(second) and not all(torch.equal(first[k], second[k]) for k in first)
    (tmp_path / "empty" / OUTPUT_MARKER).unlink()
    assert main(["make-tiny", "GLM-5.2", str(tmp_path / "empty"), "--overwrite"]) == 2
    assert all(torch.equal(second[k], v) for k, v in load_file(tmp_path / "empty" / "model.safetensors").items())


def test_plan_counts_and_refuses_bad_pipeline(capsys):
    assert main(["plan", "GLM-5.2", "--pp", "5", "--stages", "14,16,16,16,16"]) == 0
    out = capsys.readouterr().out
    assert "total 753.33B" in out and "busiest GPU" in out
    assert main(["plan", "GLM-5.2", "--pp", "2"]) == 2
    assert "starts at layer 39, an IndexShare 'shared' layer" in capsys.readouterr().err


def test_parity_command(tiny_checkpoint, capsys):
    assert main(["parity", str(tiny_checkpoint("GLM-5.1")), "--seq-len", "20"]) == 0
    assert "max |logits(Megatron) - logits(transformers)|" in capsys.readouterr().out


def test_preset_without_weights_says_so_in_one_line():
    from glm5_bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained("GLM-5.2")
    assert bridge.transformer_config.num_layers == 78
    with pytest.raises(ValueError) as err:
        bridge.to_megatron_provider(load_weights=True)
    assert "'GLM-5.2' has a config but no weights here" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("command", ["convert", "parity", "make-tiny", "make-slice", "demo", "train", "export", "plan"])
def test_every_subcommand_explains_itself(command):
    out = subprocess.run([sys.executable, "-m", "glm5_bridge.cli", command, "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "usage: glm5-bridge " + command in out.stdout
