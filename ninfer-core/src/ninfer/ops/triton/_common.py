"""Helpers shared by the Triton kernel modules: interpreter detection and small launch utilities."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Read once at import: triton itself decides between compiled and interpreted kernels when a
# @triton.jit function is defined, so the flag cannot change for the kernels of this process anyway.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

KERNEL_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})

# The triton element type of each kernel dtype (a constexpr argument when a kernel must round to a dtype that is
# none of its pointers').
TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# Programmatic dependent launch (Hopper and later): NINFER_PDL=0 turns it off (read once, like INTERPRET).
PDL_ENABLED = os.environ.get("NINFER_PDL", "1") != "0"


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


@functools.cache
def _sm90_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel that follows the PDL protocol (:func:`pdl_wait`), on ``t``'s device.

    Programmatic dependent launch lets a kernel start while the previous kernel of the stream is finishing, so its
    launch and its weight loads overlap the previous kernel's tail: in a decode step of ~12 short kernels per layer
    that tail is a large share of the time. ``{"PDL": True, "launch_pdl": True}`` on CUDA devices of compute
    capability 9.0 or later, else ``{"PDL": False}`` (a plain launch; the kernel's waits compile away).
    """
    if INTERPRET or not PDL_ENABLED or t.device.type != "cuda" or not _sm90_or_later(t.device.index or 0):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """The PDL protocol's one synchronisation point; every kernel launched with :func:`pdl` calls it once.

    Invariants (what makes an early start safe):
    - ``gdc_wait`` returns once the previous launch has completed and its writes are visible; only then does the
      kernel release its dependents (``gdc_launch_dependents``). A launch can start early only once every program
      of the previous one has released it, so while kernel N+1 runs ahead of its wait, N has passed its own wait:
      launches N-1 and earlier have completed, and only N's work after its wait can still be running.
    - Hence before ``pdl_wait`` a kernel writes nothing (but memory only its own launches touch, ordered among them
      by this protocol, e.g. per-slot ticket counters of its own) and reads only what the previous launch does not
      write: weights (no kernel writes them), or outputs of launches before the previous one (the MoE down kernel
      reads the router's ids there: the gate/up kernel runs in between), or step inputs the host copied in before
      the step (state slot ids). A wrapper that converts such an input with a kernel of its own launches the kernel
      that reads it without PDL.
    """
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# sm_90's bulk prefetch: one instruction asks L2 for a whole contiguous range; the dummy output keeps the statement
# (the asm is not pure, so it is never removed).
_L2_PREFETCH_ASM = tl.constexpr("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;")


def l2_prefetch_aligned(*byte_values: int) -> bool:
    """Whether :func:`l2_prefetch` may be asked for these: every address, row stride and size a multiple of 16
    bytes (the bulk prefetch's rule), checked by each launch that passes it ``ENABLED``."""
    return all(v % 16 == 0 for v in byte_values)


@triton.jit
def l2_prefetch(ptrs, nbytes, ENABLED: tl.constexpr, INTERP: tl.constexpr):
    """Ask L2 for ``nbytes`` (an int32 tensor shaped like ``ptrs``) at each address of ``ptrs``.

    No register receives the bytes and nothing waits for them, so the values a kernel computes are unchanged; what
    changes is when the bytes leave HBM. Before :func:`pdl_wait` a kernel may prefetch only memory no kernel writes
    (weights), the rule for any read there. Every address must be 16-byte aligned and every size a multiple of 16
    (the caller's launch checks). A no-op unless ``ENABLED``, and under the interpreter (no cache to warm)."""
    if ENABLED:
        if not INTERP:
            tl.inline_asm_elementwise(_L2_PREFETCH_ASM, "=r,l,r", [ptrs, nbytes], dtype=tl.int32, is_pure=False,
                                      pack=1)
