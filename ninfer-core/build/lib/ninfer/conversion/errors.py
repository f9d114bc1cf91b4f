"""The converter's error types, all :class:`ninfer.errors.NInferError` subclasses.

Every message names the thing at fault: the source folder and the missing file, the source
tensor, or the planned object or binding.
"""

from __future__ import annotations

from ninfer.errors import NInferError


class ConversionError(NInferError):
    """A conversion could not be completed; nothing was published."""


class SourceError(ConversionError):
    """The source checkpoint folder is missing something or is malformed."""


class PlanError(ConversionError):
    """A plugin's :class:`~ninfer.artifact.source_mapping.ConversionPlan` breaks a plan invariant."""


class OutputExistsError(ConversionError):
    """The output path already exists; the converter never overwrites."""
