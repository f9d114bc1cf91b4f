"""Helpers shared by the Triton kernel modules: interpreter detection and small launch utilities."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Read once at import: triton itself decides between compiled and interpreted kernels when a
# @triton.jit function is defined, so the flag cannot change for the kernels of this process anyway.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

KERNEL_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


def launch_ok(t: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors only under the interpreter."""
    if t.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"triton op called on a {t.device.type} tensor without TRITON_INTERPRET=1")


@triton.jit
def mm(a, b, FP32_DOT: tl.constexpr, INTERP: tl.constexpr):
    """a @ b with fp32 accumulation.

    fp32 operands use IEEE fp32 products (not tf32), so fp32 results keep fp32 accuracy. Under the
    interpreter (triton 3.9) tl.dot multiplies bf16 operands' raw bit patterns, so operands are widened to
    fp32 first: exact for bf16/fp16 values, the same products the tensor cores form.
    """
    if INTERP:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif FP32_DOT:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def cast(x, dtype: tl.constexpr, INTERP: tl.constexpr):
    """x.to(dtype), rounding to nearest even on every backend.

    The triton 3.9 interpreter truncates fp32 -> bf16 conversions (the GPU rounds to nearest even), which
    would double the output rounding error of every bf16 kernel under the CPU tests and break bit-exact
    checks; under the interpreter the rounding is therefore done on the bits here.
    """
    if INTERP:  # nested constexpr ifs rather than `and`: plain static branches on every triton version
        if dtype == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            y = x.to(dtype)
    else:
        y = x.to(dtype)
    return y
