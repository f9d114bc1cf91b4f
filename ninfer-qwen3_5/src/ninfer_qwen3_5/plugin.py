"""Entry point ``qwen3_5`` (group ``ninfer``): registers the Qwen3.5 architectures, the Qwen frontend family,
the source mappings, the ops only Qwen3.5 calls (their contracts and implementations, :mod:`.ops`) and the
speculative backends ``mtp`` (the checkpoint's own multi-token-prediction head, :mod:`.mtp`), ``dflash`` and
``dflash2`` (a separately published DFlash / DFlash2 block drafter the converter adds as the ``dflash``
component, :mod:`.dflash`)."""

from __future__ import annotations

from ninfer.contracts.architecture import ArchitectureSpec
from ninfer.contracts.frontend import FrontendSpec
from ninfer.contracts.speculative import SpeculativeBackendSpec
from ninfer.plugins.hookspecs import hookimpl

from ninfer_qwen3_5.config import DENSE, MOE
from ninfer_qwen3_5.default_model import ninfer_default_models  # noqa: F401  (a hookimpl of this plugin)
from ninfer_qwen3_5.parameters import parameter_specs


def _create_program(init):
    from ninfer_qwen3_5.program import Qwen35Program  # torch-heavy; imported when a program is built

    return Qwen35Program(init)


def _create_frontend(resources, vocab_size):
    from ninfer_qwen3_5.frontend.frontend import QwenFrontend  # tokenizers, jinja2: imported when needed

    return QwenFrontend(resources, vocab_size=vocab_size)


def _create_speculative_program(init):
    """A drafter lives inside the target's Program (it shares its KV page tables, StateImages and hidden
    states): a Qwen3.5 Program built with ``ProgramOptions.speculative_tokens > 0`` builds the one
    ``init.features.speculative`` names (default ``mtp``)."""
    from ninfer.contracts.program import ProgramError

    if init.options.speculative_tokens < 1:
        raise ProgramError(f"the {init.features.speculative or 'mtp'} backend needs "
                           f"ProgramOptions.speculative_tokens >= 1")
    return _create_program(init)


#: The ``mtp`` backend: drafts with the artifact's ``mtp`` component, for both Qwen3.5 architectures.
MTP_BACKEND = SpeculativeBackendSpec(name="mtp", architectures=(DENSE, MOE), component="mtp",
                                     create=_create_speculative_program)
#: The ``dflash`` / ``dflash2`` backends: draft with the artifact's ``dflash`` component (a first / second
#: generation drafter; the Program checks which), built like ``mtp`` inside the target's Program.
DFLASH_BACKEND = SpeculativeBackendSpec(name="dflash", architectures=(DENSE, MOE), component="dflash",
                                        create=_create_speculative_program)
DFLASH2_BACKEND = SpeculativeBackendSpec(name="dflash2", architectures=(DENSE, MOE), component="dflash",
                                         create=_create_speculative_program)

#: The Qwen frontend family: Qwen3.5 and the Qwen4-Exp plugin (which depends on this distribution) use it.
QWEN_FRONTEND = FrontendSpec(name="qwen", create=_create_frontend)


def architecture_specs() -> list[ArchitectureSpec]:
    # The profile imports torch: imported when the architectures are indexed, not with this module, which
    # every ninfer command (--help included) imports.
    from ninfer_qwen3_5.profile import profile, summarize_config

    return [ArchitectureSpec(name=name, family="qwen3_5", parameter_specs=parameter_specs, profile=profile,
                             create_program=_create_program, summarize_config=summarize_config, frontend="qwen",
                             lookahead=True, flat_steps=True)
            for name in (DENSE, MOE)]


@hookimpl
def ninfer_architectures() -> list:
    return architecture_specs()


@hookimpl
def ninfer_frontends() -> list:
    return [QWEN_FRONTEND]


@hookimpl
def ninfer_speculative_backends() -> list:
    return [MTP_BACKEND, DFLASH_BACKEND, DFLASH2_BACKEND]


@hookimpl
def ninfer_op_contracts() -> list:
    from ninfer_qwen3_5.ops.registration import op_contracts

    return op_contracts()


@hookimpl
def ninfer_ops() -> list:
    from ninfer_qwen3_5.ops.registration import op_impls  # torch (and triton) heavy: imported when indexed

    return op_impls()


@hookimpl
def ninfer_source_mappings() -> list:
    from ninfer_qwen3_5.mapping import Qwen35SourceMapping

    return [Qwen35SourceMapping()]
