"""tools/sm90_build_check.py: the launches of a run under the interpreter, built for sm_90 without a GPU. A kernel
the interpreter runs but the compiler refuses (a loop-carried variable that changes type) is named, one that builds
is counted, and the exit status says which."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

KERNELS = '''
import triton
import triton.language as tl


@triton.jit
def good(x_ptr, N: tl.constexpr, INTERP: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(x_ptr + o, tl.load(x_ptr + o) * 2)


@triton.jit
def bad(x_ptr, N: tl.constexpr, INTERP: tl.constexpr):
    acc = 0
    for i in range(N):
        acc = acc + tl.load(x_ptr + i)   # int32, then fp32: the interpreter does not mind, the compiler does
    tl.store(x_ptr, acc)
'''

TEST = '''
import torch
import sm_kernels as k


def test_launches():
    x = torch.ones(8)
    for _ in range(2):   # the same launch twice: recorded once
        k.good[(1,)](x, N=8, INTERP=True)
    {bad}
'''


def _run(tmp_path, bad: bool):
    (tmp_path / "sm_kernels.py").write_text(KERNELS)
    (tmp_path / "test_sm.py").write_text(TEST.format(bad="k.bad[(1,)](x, N=8, INTERP=True)" if bad else "pass"))
    record = tmp_path / "launches.json"
    return subprocess.run([sys.executable, str(ROOT / "tools" / "sm90_build_check.py"), "--launches", str(record),
                           "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_sm.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300), record


def test_a_kernel_that_does_not_build_is_named(tmp_path):
    run, record = _run(tmp_path, bad=True)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "DOES NOT BUILD sm_kernels.bad {'N': 8, 'INTERP': False}" in run.stdout
    assert "Loop-carried variable acc" in run.stdout
    assert "1 of 2 distinct launches build" in run.stdout
    assert "INTERP" in record.read_text()


def test_every_launch_building_exits_0(tmp_path):
    run, _ = _run(tmp_path, bad=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "1 of 1 distinct launches build" in run.stdout
