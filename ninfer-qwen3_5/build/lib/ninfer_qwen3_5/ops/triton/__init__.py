"""Triton kernels for Qwen3.5's own op contracts (CUDA, priority 10), registered only when triton imports and a
CUDA device is present (:func:`ninfer.ops.triton.plugin.available`).

Each module holds one kernel family and a module-level ``OPS`` list; the kernels follow core's Triton invariants
(:mod:`ninfer.ops.triton`: no host synchronisation in the launch path, a row's result independent of its batch,
the PDL protocol of :func:`ninfer.ops.triton._common.pdl_wait`) and use core's shared helpers
(:mod:`ninfer.ops.triton._common`, the RMS statistic of :mod:`ninfer.ops.triton.norm`, the rotation of
:mod:`ninfer.ops.triton.rope`). Importing this package does not import triton; the kernel modules do.
"""
