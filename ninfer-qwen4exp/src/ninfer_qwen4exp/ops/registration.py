"""What this plugin registers for ops: its contracts, their reference implementations and, where Triton kernels can
run, its kernels (the ``ninfer_op_contracts`` and ``ninfer_ops`` hooks of :mod:`ninfer_qwen4exp.plugin` return
these).

Invariant: every implementation returned here targets a contract of :data:`ninfer_qwen4exp.ops.contracts.CONTRACTS`
(the registry checks it when ops are resolved). Implementations are collected by
:func:`~ninfer.ops.discovery.package_ops`, so a kernel family is a new package of modules, never an edit here.
"""

from __future__ import annotations

from ninfer.ops.discovery import package_ops
from ninfer.ops.registry import OpImpl
from ninfer.ops.triton.plugin import available

from ninfer_qwen4exp.ops.contracts import CONTRACTS


def op_contracts() -> list:
    return list(CONTRACTS)


def reference_op_impls() -> list[OpImpl]:
    return package_ops("ninfer_qwen4exp.ops.reference")


def triton_op_impls() -> list[OpImpl]:
    """The Triton kernels, unconditionally (the CPU tests run them under ``TRITON_INTERPRET=1``)."""
    return package_ops("ninfer_qwen4exp.ops.triton")


def op_impls() -> list[OpImpl]:
    """The reference implementations, plus the kernels when triton imports and a CUDA device is present."""
    return reference_op_impls() + (triton_op_impls() if available() else [])
