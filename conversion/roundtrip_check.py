"""HF → Megatron → HF round trip of a GLM-5.x checkpoint, checked tensor by tensor, bit for bit.

Usage:
    python conversion/roundtrip_check.py HF_DIR [--workdir DIR]
    python conversion/roundtrip_check.py --compare HF_DIR_A HF_DIR_B

The first form converts HF_DIR to a Megatron distributed checkpoint and back (into a temporary
folder, or under --workdir and kept) and compares every tensor of the result with HF_DIR; the
second only compares two HF checkpoint folders. Prints the number of tensors compared and each
mismatch by name; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from glm5_bridge.cli import run_command, start_process


def _tensor_files(folder: Path) -> dict[str, Path]:
    """name → the *.safetensors shard of `folder` holding it."""
    from safetensors import safe_open

    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    where = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), shard))
    return where


def compare_checkpoints(a: str | Path, b: str | Path) -> tuple[int, list[str]]:
    """(tensors compared, mismatches) over every tensor of the safetensors shards of folders `a`
    and `b`; each mismatch is "name: why". Equal means same dtype, same shape and same bytes (so
    NaN == NaN and 0.0 != -0.0). Tensors are read one at a time, not whole shards."""
    import torch
    from safetensors import safe_open

    in_a, in_b = _tensor_files(Path(a)), _tensor_files(Path(b))
    mismatches = [f"{name}: only in {a}" for name in sorted(in_a.keys() - in_b.keys())]
    mismatches += [f"{name}: only in {b}" for name in sorted(in_b.keys() - in_a.keys())]
    common = sorted(in_a.keys() & in_b.keys())
    for name in common:
        with safe_open(in_a[name], framework="pt") as fa, safe_open(in_b[name], framework="pt") as fb:
            x, y = fa.get_tensor(name), fb.get_tensor(name)
        if x.dtype != y.dtype or x.shape != y.shape:
            mismatches.append(f"{name}: {x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}")
        elif not torch.equal(x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8)):
            diff = (x.double() - y.double()).abs().max().item() if x.is_floating_point() else float("nan")
            mismatches.append(f"{name}: values differ (max |diff| {diff:.3e})")
    return len(common), mismatches


def report(a, b) -> int:
    count, mismatches = compare_checkpoints(a, b)
    if not mismatches:
        print(f"{count} tensors compared: all equal bit for bit")
        return 0
    print(f"{count} tensors compared: {len(mismatches)} mismatch(es)")
    for line in mismatches:
        print(f"  MISMATCH {line}")
    return 1


def roundtrip(hf_path: Path, workdir: Path) -> Path:
    """HF → Megatron (workdir/megatron) → HF (workdir/hf); the final HF folder."""
    from glm5_bridge.convert import hf_to_megatron, megatron_to_hf

    hf_to_megatron(hf_path, workdir / "megatron")
    return megatron_to_hf(workdir / "megatron", workdir / "hf")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="HF → Megatron → HF round trip, every tensor compared bit for "
                                                 "bit with the source; exit 1 on any mismatch.")
    parser.add_argument("hf_path", nargs="?", help="HF checkpoint folder to round-trip")
    parser.add_argument("--workdir", help="write the Megatron and HF outputs here (must not hold megatron/ or hf/) "
                                          "and keep them; default: a temporary folder removed at the end")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="only compare two HF checkpoint folders")
    parser.add_argument("--debug", action="store_true", help="show upstream warnings and tracebacks")
    args = parser.parse_args(argv)
    if (args.hf_path is None) == (args.compare is None):
        parser.error("give either HF_DIR or --compare A B")
    start_process(args.debug)

    def check() -> int:
        if args.compare:
            return report(*args.compare)
        if args.workdir:
            return report(args.hf_path, roundtrip(Path(args.hf_path), Path(args.workdir)))
        with tempfile.TemporaryDirectory(prefix="glm5-roundtrip-") as tmp:
            return report(args.hf_path, roundtrip(Path(args.hf_path), Path(tmp)))

    return run_command(parser.prog, check, args.debug)


if __name__ == "__main__":
    sys.exit(main())
