"""Plugin hookspecs and the registry. See ``docs/plugins.md`` for the authoring guide."""

from ninfer.plugins.hookspecs import hookimpl, hookspec
from ninfer.plugins.registry import (
    PlannedArchitectureError,
    PluginConflictError,
    PluginError,
    PluginInfo,
    PluginRegistry,
    UnknownArchitectureError,
    UnknownSourceMappingError,
    get_registry,
    reset_registry,
)

__all__ = [
    "hookimpl", "hookspec", "PluginRegistry", "PluginInfo", "PluginError", "PluginConflictError",
    "UnknownArchitectureError", "UnknownSourceMappingError", "PlannedArchitectureError", "get_registry",
    "reset_registry",
]
