"""Core default plugin ``triton_ops``: registers the Triton kernels (priority 10, device "cuda").

Every public module of :mod:`ninfer.ops.triton` that defines a module-level ``OPS`` list contributes it
(:func:`~ninfer.ops.discovery.package_ops`, as the reference plugin does), so a new kernel family is a new
module, never an edit here. Modules whose name starts with "_" hold shared helpers and are skipped.

The hook returns nothing when triton is not importable or no CUDA device is present (:func:`available`, which
architecture plugins registering kernels of their own use too), so CPU-only installs resolve the torch reference
ops exactly as before. :func:`triton_op_impls` returns the implementations unconditionally (the CPU tests run
them on CPU tensors under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from ninfer.plugins.hookspecs import hookimpl


def triton_op_impls() -> list:
    from ninfer.ops.discovery import package_ops

    return package_ops("ninfer.ops.triton")


def available() -> bool:
    """Whether Triton kernels can run here: triton imports and a CUDA device is present."""
    try:
        import torch
        import triton  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


@hookimpl
def ninfer_ops() -> list:
    return triton_op_impls() if available() else []
