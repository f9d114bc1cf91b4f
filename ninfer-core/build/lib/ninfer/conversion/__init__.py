"""Converting a Hugging Face checkpoint folder into a V3 ``.ninfer`` artifact (docs/converter.md).

:func:`convert` runs the pipeline (:mod:`pipeline`): read the folder's headers (:mod:`source`), ask the
architecture plugin's source mapping for a plan and check it (:mod:`plan`), check the frontend resources
(:mod:`resources`, :mod:`resource_checks`), then stream every object into the artifact writer, casting where
the plan asks (:mod:`cast`). ``ninfer`` converts a named folder or the default model with it
(:mod:`ninfer.model_source`); the ``ninfer-convert`` command (the ninfer-convert distribution) is its CLI.

The public names are imported on first use (PEP 562): a plugin's config module raises these errors and is
imported by every ``ninfer`` command, which must not import the pipeline (torch) for it.
"""

__all__ = ["ConversionError", "ConversionResult", "OutputExistsError", "PlanError", "SourceError", "convert"]

# The public names and the modules that define them.
_PUBLIC = {"ConversionError": "ninfer.conversion.errors", "OutputExistsError": "ninfer.conversion.errors",
           "PlanError": "ninfer.conversion.errors", "SourceError": "ninfer.conversion.errors",
           "ConversionResult": "ninfer.conversion.pipeline", "convert": "ninfer.conversion.pipeline"}


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'ninfer.conversion' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
