"""Shared mechanics for the op qualification suites: devices, deterministic fresh inputs, comparisons.

Only mechanics live here; each test module names its own acceptance criteria per arithmetic profile
(no cross-op tolerance presets). Oracles are fp64 and written in each test module from the represented
inputs (the bf16 values actually passed), never composed from production ops; the oracles both the
reference and the Triton suites check against live in tests/ops/oracles.py, the checks both run in
tests/ops/shared_checks.py.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import pytest
import torch
from ninfer.ops import resolve_ops
from ninfer.plugins import get_registry

_CUDA = torch.cuda.is_available()

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _CUDA, reason="no CUDA device")]),
]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded from the test id: fresh inputs per test, reproducible per test."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g


def reference_ops(device: str, dtype: torch.dtype):
    """The torch reference OpSet, through the real plugin registry (so registration is exercised too)."""
    return resolve_ops(get_registry().ops, torch.device(device).type, dtype, force="reference")


#: Above this many elements a CUDA input is drawn on its device, from a seed the CPU generator draws. Only sizes
#: that the GPU alone runs get there (a 35B-A3B expert bank is 5e8 values, ~30 s to draw in fp64 on one CPU thread),
#: so the rule that every device sees the same values holds wherever a size runs on both.
DEVICE_DRAW = 1 << 22


def _draw_on_device(gen: torch.Generator, shape, device) -> torch.Generator | None:
    if len(shape) == 1 and not isinstance(shape[0], int):   # randn(gen, (a, b)) as well as randn(gen, a, b)
        shape = tuple(shape[0])
    if torch.device(device).type != "cuda" or math.prod(shape) <= DEVICE_DRAW:
        return None
    seed = int(torch.randint(0, 2 ** 62, (1,), generator=gen))
    return torch.Generator(device=device).manual_seed(seed)


def randn(gen: torch.Generator, *shape, dtype=torch.float32, device="cpu", scale=1.0) -> torch.Tensor:
    """Normal inputs drawn on CPU (identical values for every device), cast to dtype, then moved; past
    :data:`DEVICE_DRAW` elements on CUDA, drawn there in fp32 (still reproducible per test)."""
    if (dev_gen := _draw_on_device(gen, shape, device)) is not None:
        return (torch.randn(*shape, generator=dev_gen, dtype=torch.float32, device=device) * scale).to(dtype)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)


def rand(gen: torch.Generator, *shape, lo=0.0, hi=1.0, dtype=torch.float32, device="cpu") -> torch.Tensor:
    if (dev_gen := _draw_on_device(gen, shape, device)) is not None:
        return (lo + (hi - lo) * torch.rand(*shape, generator=dev_gen, dtype=torch.float32, device=device)).to(dtype)
    return (lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=torch.float64)).to(dtype).to(device)


def f64(x: torch.Tensor) -> torch.Tensor:
    """The represented value of x in fp64 on CPU (the oracle's starting point)."""
    return x.detach().to("cpu", torch.float64)


@dataclass(frozen=True)
class Normwise:
    """Reduction-type criterion: ||out - ref|| / ||ref|| <= rel and max|out - ref| <= cap * max|ref|."""

    rel: float
    cap: float


@dataclass(frozen=True)
class Pointwise:
    """Elementwise criterion: |out - ref| <= rtol * |ref| + atol * max|ref| for every element."""

    rtol: float
    atol: float


def assert_normwise(out: torch.Tensor, ref: torch.Tensor, crit: Normwise, what: str = "") -> None:
    # f64(ref) too: a reference op's output may sit on the device (the Triton suite compares against it).
    o, r = f64(out), f64(ref)
    assert o.shape == r.shape, f"{what}: shape {tuple(o.shape)} != oracle {tuple(r.shape)}"
    assert torch.isfinite(o).all(), f"{what}: non-finite output"
    ref_norm = r.norm().item()
    assert ref_norm > 0, f"{what}: degenerate all-zero oracle"
    err = (o - r).norm().item() / ref_norm
    gross = (o - r).abs().max().item() / r.abs().max().item()
    assert err <= crit.rel and gross <= crit.cap, (
        f"{what}: normwise {err:.3e} (limit {crit.rel:.1e}), pointwise {gross:.3e} (cap {crit.cap:.1e})")


def assert_pointwise(out: torch.Tensor, ref: torch.Tensor, crit: Pointwise, what: str = "") -> None:
    o, r = f64(out), f64(ref)
    assert o.shape == r.shape, f"{what}: shape {tuple(o.shape)} != oracle {tuple(r.shape)}"
    assert torch.isfinite(o).all(), f"{what}: non-finite output"
    scale = r.abs().max().item()
    assert scale > 0, f"{what}: degenerate all-zero oracle"
    excess = (o - r).abs() - (crit.rtol * r.abs() + crit.atol * scale)
    worst = excess.max().item()
    assert worst <= 0, (f"{what}: {int((excess > 0).sum())} elements over rtol {crit.rtol:.1e} / atol "
                        f"{crit.atol:.1e}; worst excess {worst:.3e}")


def assert_bits(out: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Bit-exact equality (dtype, shape and every bit, NaN payloads included)."""
    assert out.dtype == expected.dtype and out.shape == expected.shape, what
    a, b = out.detach().cpu().contiguous(), expected.detach().cpu().contiguous()
    if a.is_floating_point():
        width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(width), b.view(width)
    assert torch.equal(a, b), f"{what}: not bit-exact ({int((a != b).sum())} elements differ)"
