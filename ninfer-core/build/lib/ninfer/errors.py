"""The root of NInfer's exception hierarchy.

Each subsystem derives its own types from :class:`NInferError` so callers can catch one
family (``ArtifactError``, ``PluginError``...) and every message names the thing at fault.
"""


class NInferError(Exception):
    """Base class of every error NInfer raises on purpose."""


class NotSupportedError(NInferError):
    """A feature that exists in the design but is not implemented yet (listed in the README)."""
