"""Triton kernels for the op contracts of :mod:`ninfer.ops.contracts` (CUDA, priority 10).

Each module holds one kernel family and a module-level ``OPS`` list of
:class:`~ninfer.ops.registry.OpImpl`; :mod:`ninfer.ops.triton.plugin` registers them through the
``ninfer_ops`` hook only when triton imports and a CUDA device is present. The same kernels run on
CPU tensors under ``TRITON_INTERPRET=1`` (how the CPU test suite checks them at tiny sizes).

Invariants shared by every kernel here:
- No host synchronisation in the launch path (no ``.item()``/``.tolist()``/``bool(tensor)``): grids
  and block sizes come from tensor *shapes* only, so launches can be captured in CUDA graphs. The KV writes
  check a slot mapping's range only when it is on the host (``kv_cache.check_on_host``).
- Results depend on a row's own inputs only, never on the batch it was launched in (grid sizes change
  how many programs exist, never how a row's arithmetic is partitioned) -- except where an op picks a
  kernel by the call's size: ``moe_experts`` takes its GEMV decode path up to ``moe_gemv.MAX_PAIRS``
  (token, expert) pairs and its grouped tensor-core path above, which round differently; the quantized-weight
  ops (``quant_linear``) take the dequant-GEMV up to ``quant_gemv.MAX_ROWS`` rows and the GEMM above.
- Importing this package does not import triton; the kernel modules do.
"""
