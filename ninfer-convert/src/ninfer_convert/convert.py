"""The converter's Python entry point under this distribution's name.

The pipeline is core's :mod:`ninfer.conversion` (``ninfer`` converts a named folder or the default model
without this distribution installed); ``from ninfer.conversion import convert`` is the same function.
"""

from ninfer.conversion import ConversionResult, convert

__all__ = ["ConversionResult", "convert"]
