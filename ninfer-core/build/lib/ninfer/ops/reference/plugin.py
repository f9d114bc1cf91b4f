"""Core default plugin ``reference_ops``: registers core's op contracts and their torch reference ops.

The contracts are :data:`ninfer.ops.contracts.CORE_CONTRACTS` (the architecture-independent ops); the
implementations are the ``OPS`` lists of every module of :mod:`ninfer.ops.reference`
(:func:`~ninfer.ops.discovery.package_ops`), so adding an op means adding a module (or an entry to a module's
``OPS``), never editing this file.
"""

from __future__ import annotations

from ninfer.plugins.hookspecs import hookimpl


@hookimpl
def ninfer_op_contracts() -> list:
    from ninfer.ops.contracts import CORE_CONTRACTS

    return list(CORE_CONTRACTS)


@hookimpl
def ninfer_ops() -> list:
    from ninfer.ops.discovery import package_ops

    return package_ops("ninfer.ops.reference")
