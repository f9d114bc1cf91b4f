"""Converting a Hugging Face checkpoint folder into a V3 ``.ninfer`` artifact (docs/converter.md).

:func:`convert` runs the pipeline (:mod:`pipeline`): read the folder's headers (:mod:`source`), ask the
architecture plugin's source mapping for a plan and check it (:mod:`plan`), check the frontend resources
(:mod:`resources`, :mod:`resource_checks`), then stream every object into the artifact writer, casting where
the plan asks (:mod:`cast`). ``ninfer`` converts a named folder or the default model with it
(:mod:`ninfer.model_source`); the ``ninfer-convert`` command (the ninfer-convert distribution) is its CLI.
"""

from ninfer.conversion.errors import ConversionError, OutputExistsError, PlanError, SourceError
from ninfer.conversion.pipeline import ConversionResult, convert

__all__ = ["ConversionError", "ConversionResult", "OutputExistsError", "PlanError", "SourceError", "convert"]
