"""A killed run resumes identically (issue 9).

`glm5-bridge train` (tiny GLM-5.2, LoRA SFT, `train.deterministic=true`, a checkpoint every
SAVE_EVERY steps) runs as a real process and is SIGKILLed KILLS times, each time at a random step
(and a random moment inside it: computing, or writing a checkpoint); after each kill the same
command is started again and resumes from the last checkpoint. After the second kill a half-written
checkpoint folder and a half-written `latest` are planted as a dying save would leave them; the
resume must ignore and remove them. The run that finally completes must have the same loss curve
(loss, grad norm, lr and tokens of every step, bit for bit), final loss, LoRA weights and optimizer
state as an uninterrupted run of the same command. The number of kills survived goes to
tests/checked.json (README "What is checked").

The uninterrupted reference runs beside the killed ones (one thread each, two cores).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import _checked

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAVE_EVERY, KILLS = 12, 2, 3
PROGRESS = re.compile(rb"step (\d+)/%d\b" % STEPS)  # runlog's lines when stdout is not a terminal


class Run:
    """One `glm5-bridge train` process; `step` follows its progress lines (steps completed; the
    first line names the step it starts from)."""

    def __init__(self, checkpoint: Path, out: Path, log: Path):
        cmd = [sys.executable, "-m", "glm5_bridge.cli", "train", str(ROOT / "recipes" / "tiny_lora_sft.yaml"),
               f"model.checkpoint={checkpoint}", f"train.output_dir={out}", f"train.steps={STEPS}",
               f"train.save_every={SAVE_EVERY}", "train.warmup_steps=2", "data.limit=100", "data.max_tokens=128",
               "lora.dim=4", "train.deterministic=true", "export.kind=none"]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONUNBUFFERED="1")
        env.pop("MASTER_PORT", None)
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.step, self.first, self.output = -1, None, b""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        while chunk := os.read(self.proc.stdout.fileno(), 65536):
            self.output += chunk
            self.log.write(chunk)
            found = PROGRESS.findall(self.output[-4096:])
            if found:
                if self.first is None:  # the run starts at the step it resumed from
                    self.first = int(found[0])
                self.step = max(self.step, int(found[-1]))

    def wait_for_step(self, step: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while self.step < step:
            assert self.proc.poll() is None, f"run ended (rc {self.proc.returncode}) before step {step}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"no step {step} within {timeout}s:\n{self.tail()}"
            time.sleep(0.01)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()  # reaped: its pid is free, so its temp folders count as abandoned
        self._reader.join(10)
        self.log.close()

    def finish(self, timeout: float = 300) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(10)
        self.log.close()
        return rc

    def tail(self) -> str:
        return self.output[-3000:].decode(errors="replace")


def _latest(out: Path) -> int:
    latest = out / "checkpoints" / "latest"
    return int(latest.read_text().split("_")[1]) if latest.is_file() else 0


def _curve(out: Path) -> list[tuple]:
    return [(h["step"], h["loss"], h["grad_norm"], h["lr"], h["tokens"])
            for h in json.loads((out / "history.json").read_text())]


def _final_state(out: Path) -> dict:
    """Every tensor of the final distributed checkpoint (adapters, Adam moments, RNG), by name."""
    from megatron.core.dist_checkpointing import load_plain_tensors

    from glm5_bridge.compat import init_cpu_process_group

    init_cpu_process_group()  # a one-process group to read it with
    return load_plain_tensors(str(out / "checkpoints" / f"step_{STEPS:07d}"))


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_sigkill_at_random_steps_resumes_bit_identically(tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint("GLM-5.2")
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    # distinct, so every cycle gets further; from step 3 on, so that the step-2 checkpoint is complete when
    # the first kill comes (a kill lands anywhere in the step after the one printed, its save included)
    kill_steps = sorted(rng.sample(range(SAVE_EVERY + 1, STEPS), KILLS))
    note = f"(kill schedule seed {seed}: steps {kill_steps}; logs in {tmp_path})"

    reference = Run(checkpoint, tmp_path / "reference", tmp_path / "reference.log")
    out = tmp_path / "killed"
    cycles = []
    for i, step in enumerate(kill_steps):
        resumed_from = _latest(out)
        run = Run(checkpoint, out, tmp_path / f"killed-{i}.log")
        run.wait_for_step(step)
        time.sleep(rng.uniform(0, 0.4))  # anywhere in the next step, its checkpoint write included
        run.kill()
        cycles.append({"latest_at_start": resumed_from, "started_at": run.first, "killed_after": run.step,
                       "latest_at_kill": _latest(out)})
        assert run.first == resumed_from <= _latest(out) <= STEPS, (cycles, note)
        if i == 1:  # what a save killed mid-way leaves: a temp checkpoint folder and a temp `latest`
            pid = run.proc.pid
            half = out / "checkpoints" / f".step_{_latest(out) + SAVE_EVERY:07d}.tmp-{pid}"
            half.mkdir(parents=True, exist_ok=True)
            (half / "__0_0.distcp").write_bytes(b"PK\x03\x04 half a zip")
            (out / "checkpoints" / f".latest.tmp-{pid}").write_text("step_00")
            planted = [half, out / "checkpoints" / f".latest.tmp-{pid}"]

    resumed_from = _latest(out)
    final = Run(checkpoint, out, tmp_path / "final.log")
    assert final.finish() == 0, final.tail()
    assert final.first == resumed_from, (cycles, note)
    assert reference.finish() == 0, reference.tail()

    # Every restart resumed from the last complete checkpoint (asserted per cycle above: its progress bar
    # started there); nothing half-written survived.
    assert sum(c["latest_at_start"] > 0 for c in cycles) + (resumed_from > 0) >= KILLS - 1, (cycles, note)
    assert not any(p.exists() for p in planted), note
    leftovers = [p.name for p in (out / "checkpoints").iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert leftovers == [], note
    assert _latest(out) == STEPS

    # Same loss curve, same final loss, same LoRA weights and optimizer state: bit for bit.
    assert len(_curve(out)) == STEPS and _curve(out) == _curve(tmp_path / "reference"), note
    printed = [re.findall(r"^final loss (\S+);", (tmp_path / log).read_text(), re.M) for log in ("final.log",
                                                                                          "reference.log")]
    assert printed[0] and printed[0] == printed[1], note
    got, want = _final_state(out), _final_state(tmp_path / "reference")
    adapters = [k for k in got if ".adapter." in k and k.endswith(".weight") and "optimizer" not in k]
    moments = [k for k in got if "exp_avg" in k]
    assert adapters and moments and _equal(got, want), note

    _checked.record("kill_resume", {"kills": KILLS, "resumes": len(cycles), "steps": STEPS,
                                    "save_every": SAVE_EVERY, "test": "tests/test_kill_resume.py"})


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie nobody reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_killed_trainer_leaves_no_checkpoint_writer_behind():
    """checkpoint.prepare() starts dist_checkpointing's multiprocessing manager (a spawned process,
    with its resource tracker); when the trainer is SIGKILLed they must go too — megatron's own
    manager stayed (~585 MB a killed run, until reboot)."""
    if not sys.platform.startswith("linux"):
        import pytest

        pytest.skip("the parent-death signal is Linux's")
    script = ("import os, time\nfrom glm5_bridge.train import checkpoint\ncheckpoint.prepare()\n"
              "print(os.getpid(), flush=True)\ntime.sleep(300)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    pid = int(proc.stdout.readline())
    children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    assert children and all(_alive(c) for c in children)  # the manager (and its resource tracker)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [c for c in children if _alive(c)]
