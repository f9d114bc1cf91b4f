"""Entry point ``llama_mini`` (group ``ninfer``): the hooks this plugin implements.

The registry imports this module for every ``ninfer`` command (``--help`` too), so it imports only the light
parts of the spec (the config, the parameter list); each hook imports what it returns when the registry first
reads that kind (the profile imports torch), and the model when first built.
"""

from __future__ import annotations

from ninfer.contracts.architecture import ArchitectureSpec
from ninfer.plugins import hookimpl

from ninfer_llama_mini.config import ARCHITECTURE
from ninfer_llama_mini.parameters import parameter_specs


def _create_program(init):
    from ninfer_llama_mini.program import LlamaMiniProgram

    return LlamaMiniProgram(init)


@hookimpl
def ninfer_architectures() -> list:
    from ninfer_llama_mini.profile import profile, summarize_config

    # frontend="qwen": the byte-level BPE tokenizer.json + Jinja chat template family (ninfer-qwen3_5).
    return [ArchitectureSpec(name=ARCHITECTURE, family="llama", parameter_specs=parameter_specs, profile=profile,
                             create_program=_create_program, summarize_config=summarize_config, frontend="qwen")]


@hookimpl
def ninfer_source_mappings() -> list:
    from ninfer_llama_mini.mapping import LlamaMiniSourceMapping

    return [LlamaMiniSourceMapping()]


@hookimpl
def ninfer_op_contracts() -> list:
    from ninfer_llama_mini.ops import CONTRACTS

    return list(CONTRACTS)


@hookimpl
def ninfer_ops() -> list:
    from ninfer_llama_mini.ops import OPS

    return list(OPS)
