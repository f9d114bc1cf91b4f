"""Core default plugin: registers the torch reference ops.

Every module of :mod:`ninfer.ops.reference` that defines a module-level ``OPS`` list of
:class:`~ninfer.ops.registry.OpImpl` contributes it; adding an op means adding a module (or an
entry to a module's ``OPS``), never editing this file.
"""

from __future__ import annotations

import importlib
import pkgutil

from ninfer.plugins.hookspecs import hookimpl


@hookimpl
def ninfer_ops() -> list:
    import ninfer.ops.reference as package

    found = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name == "plugin":
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        found.extend(getattr(module, "OPS", []))
    return found
