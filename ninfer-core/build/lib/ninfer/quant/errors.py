"""Errors of weight quantization: a tensor a format cannot encode, or a layout constraint it does not meet."""

from __future__ import annotations

from ninfer.errors import NInferError


class QuantizationError(NInferError):
    """A weight cannot be stored in the requested format (shape, layout constraint or non-finite value)."""
