"""Op contracts, the op registry, torch reference ops (and, on CUDA, Triton kernels).

The public names are imported on first use (PEP 562): the core default plugins live in subpackages of this
one, and registering them (every ``ninfer`` invocation, ``--help`` included) must not import torch.
"""

__all__ = ["CORE_CONTRACTS", "OpContract", "OpError", "OpImpl", "OpSet", "resolve_ops"]

# The public names and the modules that define them.
_PUBLIC = {"CORE_CONTRACTS": "ninfer.ops.contracts", "OpContract": "ninfer.ops.contracts",
           "OpError": "ninfer.ops.registry", "OpImpl": "ninfer.ops.registry", "OpSet": "ninfer.ops.registry",
           "resolve_ops": "ninfer.ops.registry"}


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'ninfer.ops' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
