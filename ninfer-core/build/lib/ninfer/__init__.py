"""NInfer: a single-GPU LLM inference engine; architectures arrive as plugins (``ninfer plugins`` lists them).

Everything a user touches goes through :class:`ninfer.Engine`. ``Engine``, ``EngineOptions`` and ``SamplingParams`` are
imported lazily (PEP 562), so ``import ninfer`` stays light (no torch import until they are used).
This package never imports a plugin package: architectures, ops and speculative backends arrive
through the pluggy registry in :mod:`ninfer.plugins`.
"""

__version__ = "0.1.0"

__all__ = ["Engine", "EngineOptions", "SamplingParams", "__version__"]

# The public names and the modules that define them (imported on first use).
_PUBLIC = {"Engine": "ninfer.engine.engine", "EngineOptions": "ninfer.contracts.options",
           "SamplingParams": "ninfer.contracts.sampling"}


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'ninfer' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
