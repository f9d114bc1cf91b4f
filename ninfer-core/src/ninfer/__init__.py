"""NInfer: a single-GPU LLM inference engine; architectures arrive as plugins (``ninfer plugins`` lists them).

Everything a user touches goes through :class:`ninfer.Engine`. ``Engine`` and ``EngineOptions`` are
imported lazily (PEP 562), so ``import ninfer`` stays light (no torch import until they are used).
This package never imports a plugin package: architectures, ops and speculative backends arrive
through the pluggy registry in :mod:`ninfer.plugins`.
"""

__version__ = "0.1.0"

__all__ = ["Engine", "EngineOptions", "__version__"]


def __getattr__(name: str):
    if name in ("Engine", "EngineOptions"):
        from ninfer.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'ninfer' has no attribute {name!r}")
