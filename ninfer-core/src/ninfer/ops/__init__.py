"""Op contracts, the op registry, torch reference ops (and, on CUDA, Triton kernels)."""

from ninfer.ops.contracts import CONTRACTS, OpContract
from ninfer.ops.registry import OpError, OpImpl, OpSet, resolve_ops

__all__ = ["CONTRACTS", "OpContract", "OpError", "OpImpl", "OpSet", "resolve_ops"]
