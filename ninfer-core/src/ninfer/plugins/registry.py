"""Plugin registry: loads core default plugins and ``ninfer`` entry points, indexes what they register.

Invariants:
- Core default plugins (``DEFAULT_PLUGINS``) are always registered; ``NINFER_PLUGINS`` filters
  only entry points (a comma list of entry-point names; unset or empty means all).
- A name (architecture, frontend, op contract, speculative backend, source mapping, CLI command) is
  registered by at most one plugin; a clash is a :class:`PluginConflictError` naming both plugins.
- Uninstalling a plugin distribution removes exactly what it registered: nothing is cached on disk.
- Plugin modules are imported when a registry is built; the process-wide one (:func:`get_registry`) calls a
  kind's hooks the first time that kind is read, so a plugin module and its ``ninfer_cli_commands`` hook
  import nothing heavy (``ninfer --help`` runs them) and its other hooks import what they return.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import threading
from dataclasses import dataclass, field

import pluggy

from ninfer.errors import NInferError, NotSupportedError
from ninfer.plugins import hookspecs

ENTRY_POINT_GROUP = "ninfer"
ENV_FILTER = "NINFER_PLUGINS"

# Core features, registered as plugins exactly like third-party ones (module paths inside ninfer).
DEFAULT_PLUGINS: tuple[tuple[str, str], ...] = (("reference_ops", "ninfer.ops.reference.plugin"),
                                                  ("triton_ops", "ninfer.ops.triton.plugin"),
                                                  ("core_commands", "ninfer.cli.plugin"))


class PluginError(NInferError):
    """A plugin failed to load or registered something invalid."""


class PluginConflictError(PluginError):
    """Two plugins registered the same name."""


class UnknownArchitectureError(PluginError):
    """No installed plugin provides the requested architecture."""


class UnknownSourceMappingError(PluginError):
    """No installed plugin converts checkpoints of the requested architecture."""


class PlannedArchitectureError(UnknownArchitectureError, UnknownSourceMappingError, NotSupportedError):
    """The requested architecture is in the design but no plugin implements it yet (README, "Not yet
    supported"). Caught by handlers of either unknown-architecture error and of NotSupportedError."""


# Architecture names (``architectures[0]`` of a Hugging Face config) the design plans but no distribution
# implements yet: asking for one says so, instead of suggesting a plugin that does not exist. Data kept in step
# with the README's "Not yet supported"; an entry goes when its distribution ships.
PLANNED_ARCHITECTURES: dict[str, str] = {}


def _planned(name: str) -> PlannedArchitectureError | None:
    what = PLANNED_ARCHITECTURES.get(name)
    if what is None:
        return None
    return PlannedArchitectureError(f"architecture {name!r} is not supported yet: {what} is not implemented; "
                                    f"see the README's 'Not yet supported'")


@dataclass(frozen=True)
class PluginInfo:
    """One registered plugin, as ``ninfer plugins`` lists it."""

    name: str
    module: str
    distribution: str
    version: str
    default: bool
    registered: dict[str, tuple[str, ...]] = field(default_factory=dict)


def _collect(results: list[list] | None) -> list:
    return [item for batch in (results or []) for item in (batch or [])]


# What plugins register, in indexing order: each is a hook ``ninfer_<kind>`` and a registry attribute.
KINDS: tuple[str, ...] = ("architectures", "frontends", "op_contracts", "ops", "speculative_backends",
                          "source_mappings", "default_models", "cli_commands")
# What `ninfer plugins` lists per plugin: the kinds, and after its source mappings the checkpoint classes they take.
_LISTED: tuple[str, ...] = tuple(k for kind in KINDS
                                 for k in ((kind, "source_architectures") if kind == "source_mappings" else (kind,)))


# The attributes the registry and its readers use of each kind's items (duck-typed: checking the classes would
# import torch for ``ninfer --help``); an item without one is refused at indexing, naming its plugin.
_REQUIRED: dict[str, tuple[str, ...]] = {
    "architectures": ("name", "frontend", "parameter_specs", "profile", "create_program"),
    "frontends": ("name", "create"),
    "op_contracts": ("name", "signature"),
    "ops": ("op", "name", "devices", "fn"),
    "speculative_backends": ("name", "architectures", "create"),
    "source_mappings": ("name", "source_architectures", "plan"),
    "default_models": ("name", "source"),
    "cli_commands": ("name", "add_arguments", "run"),
}


def _check_item(kind: str, item: object, owner: str) -> None:
    what = kind[:-1].replace("_", " ")
    missing = next((a for a in _REQUIRED[kind] if not hasattr(item, a)), None)
    if missing is not None:
        raise PluginError(f"plugin {owner!r}: hook ninfer_{kind} returned {type(item).__name__} {item!r:.60}, "
                          f"which is not a {what} (it has no {missing!r})")
    keys = item.source_architectures if kind == "source_mappings" else (item.name,)
    if (not isinstance(keys, (tuple, list)) or not keys
            or not all(isinstance(k, str) and k for k in keys)):
        field = "source_architectures" if kind == "source_mappings" else "name"
        value = getattr(item, field)
        raise PluginError(f"plugin {owner!r}: an item of hook ninfer_{kind} has {field} {value!r}; "
                          f"it must be {'a non-empty list of names' if field != 'name' else 'a non-empty string'}")


class PluginRegistry:
    """The loaded plugin set. Build one with :func:`get_registry` (cached) or directly in tests.

    Plugin modules are imported when the registry is built. ``lazy=False`` (the default) indexes every kind
    then, so a clash or a failing hook raises from the constructor; ``lazy=True`` indexes a kind (calls its
    hooks, checks its names) the first time its attribute is read, so a process that needs only the CLI
    commands (``ninfer --help``) never calls the hooks that import torch. Either way a kind is indexed once.
    """

    def __init__(self, *, load_entry_points: bool = True, only: set[str] | None = None,
                 extra_plugins: tuple[object, ...] = (), lazy: bool = False) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._meta: dict[str, tuple[str, str, str, bool]] = {}
        self._tables: dict[str, dict | list] = {}
        self._labels: dict[str, dict[str, tuple[str, ...]]] = {}
        self._lock = threading.RLock()  # an engine thread and a server thread may read a kind first at once
        for name, modname in DEFAULT_PLUGINS:
            module = importlib.import_module(modname)
            self._register(module, name, modname, "ninfer-core", _version("ninfer-core"), default=True)
        if load_entry_points:
            self._load_entry_points(only)
        for plugin in extra_plugins:
            name = getattr(plugin, "__name__", type(plugin).__name__)
            self._register(plugin, name, name, "(in-process)", "", default=False)
        if not lazy:
            self._index_all()

    # -- loading -----------------------------------------------------------------------------
    def _load_entry_points(self, only: set[str] | None) -> None:
        seen: set[str] = set()
        for ep in md.entry_points(group=ENTRY_POINT_GROUP):
            if only is not None and ep.name not in only:
                continue
            if ep.name in seen:  # the same distribution visible twice on sys.path
                continue
            seen.add(ep.name)
            try:
                module = ep.load()
            except Exception as exc:  # a broken plugin must say which one it is
                raise PluginError(f"plugin entry point {ep.name!r} ({ep.value}) failed to load: {exc}") from exc
            dist = ep.dist.name if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else "?"
            self._register(module, ep.name, ep.value, dist, version, default=False)

    def _register(self, module: object, name: str, modpath: str, dist: str, version: str, *,
                  default: bool) -> None:
        if self.pm.get_plugin(name) is not None:
            raise PluginConflictError(f"two plugins are named {name!r}")
        try:
            self.pm.register(module, name=name)
        except Exception as exc:  # pluggy validates hookimpl signatures against the specs
            raise PluginError(f"plugin {name!r} ({modpath}) is invalid: {exc}") from exc
        self._meta[name] = (modpath, dist, version, default)

    # -- indexing ------------------------------------------------------------------------------
    def _index_all(self) -> None:
        for kind in KINDS:
            self._table(kind)

    def _table(self, kind: str) -> dict | list:
        with self._lock:
            table = self._tables.get(kind)
            if table is None:
                table = self._tables[kind] = self._index(kind)
            return table

    def _index(self, kind: str) -> dict | list:
        """Call every plugin's ``ninfer_<kind>`` hook once, one plugin at a time, so each item has a known
        owner; a name two plugins register is a PluginConflictError naming both."""
        table: dict | list = [] if kind == "ops" else {}
        labels: dict[str, list[str]] = {}
        owners: dict[str, str] = {}
        caller = getattr(self.pm.hook, f"ninfer_{kind}")
        # get_hookimpls() lists impls in registration order (pluggy *calls* them last-registered-first):
        # items are indexed in that order, so core's defaults come first and the first default model wins.
        for impl in caller.get_hookimpls():
            owner = impl.plugin_name
            try:
                items = list(impl.function() or [])
            except Exception as exc:
                raise PluginError(f"plugin {owner!r} failed in hook ninfer_{kind}: {exc}") from exc
            mine = labels.setdefault(owner, [])
            for item in items:
                _check_item(kind, item, owner)
                if kind == "ops":
                    table.append(item)
                    mine.append(f"{item.op}:{item.name}")
                    continue
                keys = item.source_architectures if kind == "source_mappings" else (item.name,)
                for key in keys:
                    if key in owners:
                        raise PluginConflictError(
                            f"{kind[:-1].replace('_', ' ')} {key!r} is registered by both plugin "
                            f"{owners[key]!r} and plugin {owner!r}")
                    owners[key] = owner
                    table[key] = item
                mine.append(item.name)
        for owner, names in labels.items():
            if names:
                self._labels.setdefault(owner, {})[kind] = tuple(names)
        if kind == "source_mappings":   # the checkpoint classes each plugin converts, for `ninfer plugins`
            for owner in labels:
                keys = tuple(key for key, who in owners.items() if who == owner)
                if keys:
                    self._labels.setdefault(owner, {})["source_architectures"] = keys
        return table

    @property
    def architectures(self) -> dict:
        return self._table("architectures")

    @property
    def frontends(self) -> dict:
        return self._table("frontends")

    @property
    def op_contracts(self) -> dict:
        return self._table("op_contracts")

    @property
    def ops(self) -> list:
        return self._table("ops")

    @property
    def speculative_backends(self) -> dict:
        return self._table("speculative_backends")

    @property
    def source_mappings(self) -> dict:
        return self._table("source_mappings")

    @property
    def default_models(self) -> dict:
        return self._table("default_models")

    @property
    def cli_commands(self) -> dict:
        return self._table("cli_commands")

    # -- queries -------------------------------------------------------------------------------
    def plugins(self) -> list[PluginInfo]:
        """Every loaded plugin with what it registered (indexes every kind)."""
        self._index_all()
        return [PluginInfo(name, modpath, dist, version, default,
                           {k: self._labels[name][k] for k in _LISTED if k in self._labels.get(name, {})})
                for name, (modpath, dist, version, default) in self._meta.items()]

    def architecture(self, name: str):
        try:
            return self.architectures[name]
        except KeyError:
            if (planned := _planned(name)) is not None:
                raise planned from None
            known = ", ".join(sorted(self.architectures)) or "none"
            raise UnknownArchitectureError(
                f"no installed plugin provides architecture {name!r} (installed: {known}); "
                f"install the plugin distribution that provides it ('ninfer plugins' lists the loaded plugins)"
                f"{filter_note()}") from None

    def source_mapping(self, architecture: str):
        try:
            return self.source_mappings[architecture]
        except KeyError:
            if (planned := _planned(architecture)) is not None:
                raise planned from None
            known = ", ".join(sorted(self.source_mappings)) or "none"
            raise UnknownSourceMappingError(
                f"no installed plugin converts checkpoints of architecture {architecture!r} "
                f"(convertible: {known}){filter_note()}") from None


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "?"


def filter_note() -> str:
    """``""``, or a clause saying that ``NINFER_PLUGINS`` limits the loaded plugins, for messages that list what is
    installed: a plugin left out by the filter is installed but not loaded."""
    raw = os.environ.get(ENV_FILTER, "").strip()
    return f"; {ENV_FILTER}={raw!r} limits which installed plugins load" if raw else ""


def _filter_from_env() -> set[str] | None:
    raw = os.environ.get(ENV_FILTER, "").strip()
    if not raw:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


_lock = threading.Lock()
_cached: tuple[str, PluginRegistry] | None = None


def get_registry() -> PluginRegistry:
    """The process-wide registry, rebuilt when ``NINFER_PLUGINS`` changes. It is lazy: each kind is indexed
    when first read, so ``ninfer --help`` calls only the plugins' ``ninfer_cli_commands`` hooks."""
    global _cached
    key = os.environ.get(ENV_FILTER, "")
    with _lock:
        if _cached is None or _cached[0] != key:
            _cached = (key, PluginRegistry(only=_filter_from_env(), lazy=True))
        return _cached[1]


def reset_registry() -> None:
    """Forget the cached registry (tests that install or remove plugins call this)."""
    global _cached
    with _lock:
        _cached = None
