"""Collecting a package's op implementations, so adding a kernel family never edits a registration hook.

Invariant: :func:`package_ops` returns the module-level ``OPS`` lists of every public module of the package, in
module-name order; modules named ``plugin`` (the hook module itself) or starting with "_" (shared helpers) are
skipped. Core's default plugins and architecture plugins register their reference and Triton packages this way.
"""

from __future__ import annotations

import importlib
import pkgutil

from ninfer.ops.registry import OpImpl


def package_ops(package: str) -> list[OpImpl]:
    """Every :class:`~ninfer.ops.registry.OpImpl` in the ``OPS`` lists of ``package``'s public modules."""
    root = importlib.import_module(package)
    found: list[OpImpl] = []
    for info in sorted(pkgutil.iter_modules(root.__path__), key=lambda m: m.name):
        if info.name == "plugin" or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        found.extend(getattr(module, "OPS", []))
    return found
