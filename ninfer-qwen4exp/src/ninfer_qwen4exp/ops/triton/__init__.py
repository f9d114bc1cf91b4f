"""Triton kernels for Qwen4-Exp's own op contracts (CUDA, priority 10), registered only when triton imports and a
CUDA device is present (:func:`ninfer.ops.triton.plugin.available`).

Each module holds one kernel family and a module-level ``OPS`` list; the kernels follow core's Triton invariants
(:mod:`ninfer.ops.triton`: no host synchronisation in the launch path, a row's result independent of its batch) and
use core's shared helpers (:mod:`ninfer.ops.triton._common`). Importing this package does not import triton; the
kernel modules do.
"""
