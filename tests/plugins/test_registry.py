"""Plugin discovery: core defaults, entry points of installed distributions, NINFER_PLUGINS, clashes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import types

import pytest
from ninfer.contracts.architecture import ArchitectureSpec, ModelProfile
from ninfer.plugins import (
    PluginConflictError,
    PluginRegistry,
    UnknownArchitectureError,
    UnknownSourceMappingError,
    hookimpl,
)

TOY_PYPROJECT = """
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "ninfer-toyarch"
version = "0.7.3"
dependencies = []

[project.entry-points.ninfer]
toyarch = "ninfer_toyarch.plugin"

[tool.setuptools.packages.find]
where = ["src"]
"""

TOY_PLUGIN = '''
from ninfer.plugins import hookimpl
from ninfer.contracts.architecture import ArchitectureSpec, ModelProfile


def _specs(config, features):
    return []


def _profile(config, features):
    return ModelProfile(0, 0, 0, int(config.get("vocab_size", 1)), 1)


def _program(init):
    raise RuntimeError("the toy architecture has no Program")


@hookimpl
def ninfer_architectures():
    return [ArchitectureSpec(name="ToyForCausalLM", family="toy", parameter_specs=_specs, profile=_profile,
                             create_program=_program, summarize_config=lambda c: dict(c), frontend="toy")]
'''


def _toy_spec(name: str) -> ArchitectureSpec:
    return ArchitectureSpec(name=name, family="toy", parameter_specs=lambda c, f: [],
                            profile=lambda c, f: ModelProfile(0, 0, 0, 1, 1),
                            create_program=lambda init: None, summarize_config=lambda c: {}, frontend="toy")


def _plugin_module(name: str, arch: str) -> types.ModuleType:
    module = types.ModuleType(name)

    @hookimpl
    def ninfer_architectures():
        return [_toy_spec(arch)]

    module.ninfer_architectures = ninfer_architectures
    return module


@pytest.fixture(scope="module")
def toy_site(tmp_path_factory):
    """A real throwaway distribution, built and pip-installed into a temporary site dir."""
    root = tmp_path_factory.mktemp("toyarch")
    src = root / "project"
    (src / "src" / "ninfer_toyarch").mkdir(parents=True)
    (src / "pyproject.toml").write_text(TOY_PYPROJECT)
    (src / "src" / "ninfer_toyarch" / "__init__.py").write_text("")
    (src / "src" / "ninfer_toyarch" / "plugin.py").write_text(textwrap.dedent(TOY_PLUGIN))
    site = root / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(src)], check=True, capture_output=True)
    yield site
    shutil.rmtree(root)


def _plugins_json(env_extra: dict[str, str]) -> list[dict]:
    env = dict(os.environ)
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-m", "ninfer.cli.main", "plugins", "--json"], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_core_defaults_are_plugins_with_ops():
    reg = PluginRegistry(load_entry_points=False)
    infos = {i.name: i for i in reg.plugins()}
    assert infos["reference_ops"].default
    assert infos["reference_ops"].distribution == "ninfer-core"
    # Every registered op names a contract (OpImpl validates that on construction).
    assert all(impl.op for impl in reg.ops)


def test_installed_distribution_is_discovered_then_removed(toy_site):
    env = {"PYTHONPATH": os.pathsep.join([str(toy_site), os.environ.get("PYTHONPATH", "")])}
    listed = {p["name"]: p for p in _plugins_json(env)}
    toy = listed["toyarch"]
    assert toy["distribution"] == "ninfer-toyarch"
    assert toy["version"] == "0.7.3"
    assert toy["registered"] == {"architectures": ["ToyForCausalLM"]}
    assert listed["reference_ops"]["default"] is True

    # NINFER_PLUGINS restricts entry points; core defaults stay.
    def loaded(filter_: str) -> tuple[set[str], set[str]]:
        plugins = _plugins_json({**env, "NINFER_PLUGINS": filter_})
        return ({p["name"] for p in plugins if not p["default"]}, {p["name"] for p in plugins if p["default"]})

    entry_points, defaults = loaded("toyarch")
    assert entry_points == {"toyarch"} and "reference_ops" in defaults
    entry_points, defaults = loaded("nothing-by-this-name")
    assert entry_points == set() and "reference_ops" in defaults

    # Uninstalling (the site dir disappears) removes exactly what it registered.
    moved = toy_site.with_name("site-removed")
    toy_site.rename(moved)
    try:
        after = {p["name"] for p in _plugins_json(env)}
        assert "toyarch" not in after and "reference_ops" in after
    finally:
        moved.rename(toy_site)


def test_plugins_command_prints_table(toy_site):
    env = dict(os.environ, PYTHONPATH=str(toy_site))
    out = subprocess.run([sys.executable, "-m", "ninfer.cli.main", "plugins"], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert "toyarch: ninfer-toyarch 0.7.3" in out
    assert "architectures: ToyForCausalLM" in out


def test_unknown_architecture_names_it():
    reg = PluginRegistry(load_entry_points=False)
    with pytest.raises(UnknownArchitectureError, match="'NoSuchForCausalLM'") as err:
        reg.architecture("NoSuchForCausalLM")
    assert "install the plugin distribution that provides it" in str(err.value)
    assert "qwen" not in str(err.value).lower()  # core suggests no particular plugin
    with pytest.raises(UnknownSourceMappingError, match="'NoSuchForCausalLM'"):
        reg.source_mapping("NoSuchForCausalLM")


def test_a_planned_architecture_is_not_supported_yet(monkeypatch):
    """An architecture the design plans but no distribution implements: engine and converter lookups say 'not
    supported yet' (NotSupportedError, still an unknown-architecture error for existing handlers), not 'install a
    plugin'."""
    from ninfer.errors import NotSupportedError
    from ninfer.plugins import registry

    name = "PlannedForCausalLM"
    monkeypatch.setitem(registry.PLANNED_ARCHITECTURES, name, "Planned (planned distribution: ninfer-planned)")
    reg = PluginRegistry(load_entry_points=False)
    for lookup in (reg.architecture, reg.source_mapping):
        with pytest.raises(NotSupportedError, match=f"{name!r} is not supported yet: Planned") as err:
            lookup(name)
        assert isinstance(err.value, UnknownArchitectureError | UnknownSourceMappingError)
        assert "pip install" not in str(err.value)


def test_in_process_plugin_registers_architecture():
    reg = PluginRegistry(load_entry_points=False, extra_plugins=(_plugin_module("toy_a", "AForCausalLM"),))
    assert reg.architecture("AForCausalLM").family == "toy"
    assert {i.name for i in reg.plugins()} >= {"toy_a", "reference_ops"}


@pytest.mark.parametrize("kind, item, match", [
    ("source_mappings", object(), r"hook ninfer_source_mappings returned object .*not a source mapping "
                                  r"\(it has no 'name'\)"),
    ("source_mappings", types.SimpleNamespace(name="m", source_architectures="XForCausalLM", plan=None),
     r"an item of hook ninfer_source_mappings has source_architectures 'XForCausalLM'; it must be a non-empty list of names"),
    ("architectures", types.SimpleNamespace(name="", frontend="f", parameter_specs=None, profile=None,
                                            create_program=None), r".*has name ''; it must be a non-empty string"),
    ("frontends", "qwen", r"hook ninfer_frontends returned str 'qwen', which is not a frontend \(it has no 'name'\)"),
])
def test_a_malformed_registration_names_its_plugin(kind, item, match):
    """A hook item missing what the registry and its readers use is refused when its kind is indexed, naming the
    plugin, instead of an AttributeError from wherever it is first used."""
    from ninfer.plugins import PluginError

    module = types.ModuleType("toy_bad")

    def hook():
        return [item]

    setattr(module, f"ninfer_{kind}", hookimpl(hook))
    reg = PluginRegistry(load_entry_points=False, extra_plugins=(module,), lazy=True)
    with pytest.raises(PluginError, match=r"plugin 'toy_bad': " + match):
        getattr(reg, kind)


def test_a_lookup_under_a_plugin_filter_says_so(monkeypatch):
    reg = PluginRegistry(load_entry_points=False)
    monkeypatch.setenv("NINFER_PLUGINS", "toyarch")
    with pytest.raises(UnknownArchitectureError, match=r"NINFER_PLUGINS='toyarch' limits which installed plugins"):
        reg.architecture("NoSuchForCausalLM")
    monkeypatch.delenv("NINFER_PLUGINS")
    with pytest.raises(UnknownSourceMappingError) as err:
        reg.source_mapping("NoSuchForCausalLM")
    assert "NINFER_PLUGINS" not in str(err.value)


def test_two_plugins_claiming_one_architecture_conflict():
    a = _plugin_module("toy_a", "SameForCausalLM")
    b = _plugin_module("toy_b", "SameForCausalLM")
    with pytest.raises(PluginConflictError, match="'toy_a'.*'toy_b'|'toy_b'.*'toy_a'"):
        PluginRegistry(load_entry_points=False, extra_plugins=(a, b))


def test_a_lazy_registry_indexes_a_kind_when_it_is_first_read():
    """``lazy=True`` (the process-wide registry) calls a kind's hooks on first read, once; the eager default
    raises a clash from the constructor, a lazy one from the first read of the clashing kind."""
    calls: list[str] = []

    def counting(name: str, arch: str) -> types.ModuleType:
        module = types.ModuleType(name)

        @hookimpl
        def ninfer_architectures():
            calls.append(name)
            return [_toy_spec(arch)]

        module.ninfer_architectures = ninfer_architectures
        return module

    reg = PluginRegistry(load_entry_points=False, extra_plugins=(counting("toy_a", "AForCausalLM"),), lazy=True)
    assert "generate" in reg.cli_commands
    assert calls == []
    assert reg.architecture("AForCausalLM").family == "toy"
    reg.architectures  # noqa: B018
    assert calls == ["toy_a"]
    assert {i.name: i.registered for i in reg.plugins()}["toy_a"] == {"architectures": ("AForCausalLM",)}

    clash = (counting("toy_b", "SameForCausalLM"), counting("toy_c", "SameForCausalLM"))
    reg = PluginRegistry(load_entry_points=False, extra_plugins=clash, lazy=True)
    assert "generate" in reg.cli_commands
    with pytest.raises(PluginConflictError, match="'toy_b'.*'toy_c'"):
        reg.architectures  # noqa: B018
    with pytest.raises(PluginConflictError, match="'toy_b'.*'toy_c'"):
        PluginRegistry(load_entry_points=False, extra_plugins=clash)


def test_real_entry_points_include_qwen3_5_and_serve():
    reg = PluginRegistry()
    infos = {i.name: i for i in reg.plugins()}
    assert "qwen3_5" in infos
    assert infos["serve"].distribution == "ninfer-serve" and infos["serve"].registered == {"cli_commands": ("serve", "bench-serve")}


def test_the_first_registered_default_model_is_the_default(tmp_path):
    """Items are indexed in registration order (pluggy calls hooks in the reverse one)."""
    from ninfer.model_source import DefaultModel, default_model

    def shipping(name: str) -> types.ModuleType:
        module = types.ModuleType(name)

        @hookimpl
        def ninfer_default_models():
            return [DefaultModel(name, tmp_path / name)]

        module.ninfer_default_models = ninfer_default_models
        return module

    reg = PluginRegistry(load_entry_points=False, extra_plugins=(shipping("first"), shipping("second")))
    assert list(reg.default_models) == ["first", "second"]
    assert default_model(reg).name == "first"


def test_no_default_model_names_no_particular_plugin():
    from ninfer.model_source import ModelSourceError, default_model

    with pytest.raises(ModelSourceError, match="no installed plugin ships a default model") as err:
        default_model(PluginRegistry(load_entry_points=False))
    assert "qwen" not in str(err.value).lower()
