"""NInfer: a single-GPU inference engine for the Qwen hybrid architectures.

Everything a user touches goes through :class:`ninfer.Engine` (added with the engine core).
This package never imports a plugin package: architectures, ops and speculative backends
arrive through the pluggy registry in :mod:`ninfer.plugins`.
"""

__version__ = "0.1.0"
