"""The one place where NInfer's plugin hooks are declared.

Every hook returns a list of contract objects; the registry (:mod:`ninfer.plugins.registry`)
collects the lists of all registered plugins and indexes them by name. A plugin distribution
declares an entry point in group ``ninfer`` whose target module defines some of these hooks,
each decorated with :data:`hookimpl`. Core features are registered the same way, as default
plugins (see ``registry.DEFAULT_PLUGINS``).
"""

from __future__ import annotations

import pluggy

PROJECT = "ninfer"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def ninfer_architectures() -> list:  # list[ninfer.contracts.architecture.ArchitectureSpec]
    """Model architectures this plugin runs, keyed by ``ArchitectureSpec.name``.

    The name is ``architectures[0]`` of the artifact's ``text`` component config. Two plugins
    must not register the same name.
    """


@hookspec
def ninfer_frontends() -> list:  # list[ninfer.contracts.frontend.FrontendSpec]
    """Frontend families (tokenizer, chat template, output parsing), keyed by ``FrontendSpec.name``.

    An architecture names the family its artifacts are read with (``ArchitectureSpec.frontend``);
    several architectures may share one family, and a plugin may reuse another plugin's family by
    depending on its distribution.
    """


@hookspec
def ninfer_op_contracts() -> list:  # list[ninfer.ops.contracts.OpContract]
    """Op contracts (name, signature, semantics) this plugin defines, keyed by ``OpContract.name``.

    Core registers the generic ones (linear, norms, attention, sampling, ...); an architecture plugin
    registers the ops only its models call. An implementation (``ninfer_ops``) must target a
    registered contract. Two plugins must not register the same name.
    """


@hookspec
def ninfer_ops() -> list:  # list[ninfer.ops.registry.OpImpl]
    """Implementations of op contracts (see :mod:`ninfer.ops.contracts`).

    Several implementations of one op may coexist; the registry picks, for a device type and
    dtype, the supporting implementation with the highest priority.
    """


@hookspec
def ninfer_speculative_backends() -> list:  # list[ninfer.contracts.speculative.SpeculativeBackendSpec]
    """Speculative decoding backends (MTP, DFlash, ...), each for named architectures."""


@hookspec
def ninfer_source_mappings() -> list:  # list[ninfer.artifact.source_mapping.SourceMapping]
    """Converter source mappings: how a Hugging Face checkpoint of an architecture becomes
    components, objects and bindings of a V3 artifact."""


@hookspec
def ninfer_default_models() -> list:  # list[ninfer.model_source.DefaultModel]
    """Models a plugin ships inside its distribution (Hugging Face folders), used when the user names
    no model. The first registered one is the default; ``ninfer plugins`` lists them all."""


@hookspec
def ninfer_cli_commands() -> list:  # list[ninfer.cli.command.CliCommand]
    """Subcommands of the ``ninfer`` command (``ninfer serve`` comes from ninfer-serve this way), keyed by
    ``CliCommand.name``. Two plugins must not register the same name."""

