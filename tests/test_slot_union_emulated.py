"""slot_union's CUDA union kernel (UNION_GROUP) on the CPU: g++ compiles the very device function
against tests/cuda_emulation/block.h (each CUDA thread a std::thread, __syncthreads a barrier, warp
shuffles and ballots through a shared array), and union_check.cpp compares every group's union,
token bits and count with a std::map: keys over one and over seven windows of the key map, empty
tokens, short last groups, top-k 2048 and 64. This checks the kernel's logic only; tests/gpu runs it on the GPU."""

import shutil
import subprocess
from pathlib import Path

import pytest

from glm5_bridge.kernels.slot_union import UNION_GROUP, WINDOW

HERE = Path(__file__).parent / "cuda_emulation"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ with C++20")
def test_union_kernel_logic_in_emulated_thread_blocks(tmp_path):
    (tmp_path / "union.inc").write_text(UNION_GROUP)
    exe = tmp_path / "union_check"
    build = subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-w", f"-I{tmp_path}", f"-DWINDOW={WINDOW}", "-o", str(exe),
                            str(HERE / "union_check.cpp")], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    print(run.stdout)
    assert run.returncode == 0, run.stdout
    assert run.stdout.count(": 0 of") == 8
