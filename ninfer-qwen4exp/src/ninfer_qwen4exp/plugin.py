"""Entry point ``qwen4exp`` (group ``ninfer``): registers the Qwen4-Exp architecture, its source mapping (both
``Qwen4ExpForCausalLM`` and ``Qwen4ExpForConditionalGeneration`` checkpoints) and the ops only Qwen4-Exp calls
(:mod:`.ops`). The frontend is ninfer-qwen3_5's ``qwen`` family, resolved by name.

The registry imports this module for every ``ninfer`` command: it imports only the light parts of the spec, and each
hook imports what it returns when the registry first reads that kind.
"""

from __future__ import annotations

from ninfer.contracts.architecture import ArchitectureSpec
from ninfer.plugins.hookspecs import hookimpl

from ninfer_qwen4exp.config import ARCHITECTURE
from ninfer_qwen4exp.parameters import parameter_specs


def _create_program(init):
    from ninfer_qwen4exp.program import Qwen4ExpProgram  # torch-heavy; imported when a program is built

    return Qwen4ExpProgram(init)


@hookimpl
def ninfer_architectures() -> list:
    from ninfer_qwen4exp.profile import profile, summarize_config

    return [ArchitectureSpec(name=ARCHITECTURE, family="qwen4exp", parameter_specs=parameter_specs, profile=profile,
                             create_program=_create_program, summarize_config=summarize_config, frontend="qwen")]


@hookimpl
def ninfer_op_contracts() -> list:
    from ninfer_qwen4exp.ops.registration import op_contracts

    return op_contracts()


@hookimpl
def ninfer_ops() -> list:
    from ninfer_qwen4exp.ops.registration import op_impls

    return op_impls()


@hookimpl
def ninfer_source_mappings() -> list:
    from ninfer_qwen4exp.mapping import Qwen4ExpSourceMapping

    return [Qwen4ExpSourceMapping()]
