"""Op contracts, the op registry, torch reference ops (and, on CUDA, Triton kernels)."""

from ninfer.ops.contracts import CORE_CONTRACTS, OpContract
from ninfer.ops.registry import OpError, OpImpl, OpSet, resolve_ops

__all__ = ["CORE_CONTRACTS", "OpContract", "OpError", "OpImpl", "OpSet", "resolve_ops"]
