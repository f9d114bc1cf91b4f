"""Building an architecture's Program from an artifact the way startup does, without an Engine, and reading
its logits through the scoring path.

:func:`build_program` reads the artifact, asks the registered :class:`~ninfer.contracts.architecture.ArchitectureSpec`
for its parameters and :class:`~ninfer.contracts.architecture.ModelProfile`, loads the weights and calls
``create_program`` with explicit :class:`~ninfer.contracts.architecture.ProgramOptions`; no memory planning, so
the sizes are exactly the ones asked for (what :mod:`ninfer.testing.profiles` measures against the profile).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ninfer.artifact import ArtifactReader, load_weights
from ninfer.contracts.architecture import ModelProfile, ProgramInit, ProgramOptions
from ninfer.contracts.features import StartupFeatures
from ninfer.contracts.program import ProgramError
from ninfer.ops import resolve_ops
from ninfer.planning.planner import weight_source
from ninfer.plugins import get_registry


@dataclass(frozen=True)
class BuiltProgram:
    """A Program and what it was built from. ``weights``: the loader's tensors as handed to ``create_program``
    (in their stored dtypes); ``load_bytes``: what the planner budgets for loading them; ``profile``: the
    architecture's profile for ``options.dtype`` and the stored dtypes; ``host_parameters``: the parameters placed
    in host memory (``ParameterSpec.placement``), ``host_load_bytes`` what the planner budgets for loading them."""

    program: Any
    profile: ModelProfile
    weights: Mapping[str, torch.Tensor]
    load_bytes: int
    options: ProgramOptions
    config: Mapping[str, Any]
    host_parameters: tuple[str, ...] = ()
    host_load_bytes: int = 0


def build_program(artifact: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                  max_sequences: int = 2, page_size: int = 4, num_pages: int = 64, max_context: int | None = None,
                  checkpoint_slots: int = 0, ops: str | None = "reference", registry=None,
                  features: StartupFeatures | None = None) -> BuiltProgram:
    """The Program of ``artifact``'s text architecture for ``dtype`` on ``device``. ``max_context`` defaults to
    the pool's capacity (``num_pages * page_size``); ``ops="reference"`` forces the torch reference ops (None:
    the registry's choice for the device, as the engine makes it); ``registry``: default
    :func:`~ninfer.plugins.get_registry`; ``features``: default text only."""
    registry = registry or get_registry()
    features = features or StartupFeatures()
    with ArtifactReader.open(artifact) as reader:
        config = reader.component("text").config
        spec = registry.architecture(config["architectures"][0])
        specs = spec.parameter_specs(config, features)
        source = weight_source(reader, specs)
        weights = load_weights(reader, specs, device)
    profile = spec.profile(config, features, dtype=dtype, stored_dtypes=source.stored_dtypes,
                           packed_bytes=source.packed_bytes)
    opset = resolve_ops(registry.ops, torch.device(device).type, dtype, contracts=registry.op_contracts, force=ops)
    options = ProgramOptions(device=torch.device(device), dtype=dtype, max_sequences=max_sequences,
                             page_size=page_size, num_pages=num_pages,
                             max_context=max_context or num_pages * page_size, checkpoint_slots=checkpoint_slots)
    program = spec.create_program(ProgramInit(config=config, weights=weights, ops=opset, options=options,
                                              features=features))
    return BuiltProgram(program=program, profile=profile, weights=weights, load_bytes=source.load_bytes,
                        options=options, config=config,
                        host_parameters=tuple(s.name for s in specs if s.placement == "host"),
                        host_load_bytes=source.host_load_bytes)


def program_logits(program, token_ids: Sequence[int], *, chunk: int | None = None) -> torch.Tensor:
    """fp32 logits ``[T, vocab]`` on the CPU, row ``t`` predicting the token after ``token_ids[:t + 1]``,
    computed by ``program.score_chunk`` in chunks of ``chunk`` tokens (None: one chunk), so every chunk after
    the first attends over the KV the earlier ones wrote. The sequence is released afterwards."""
    tokens = [int(t) for t in token_ids]
    chunk = chunk or len(tokens)
    seq = program.open_sequence(tokens)
    try:
        if not program.reserve_units({seq: len(tokens)})[seq]:
            raise ProgramError(f"the Program cannot hold {len(tokens)} tokens (max_context {program.max_context}, "
                               f"or too few KV pages)")
        rows = [program.score_chunk(seq, min(chunk, len(tokens) - start)) for start in range(0, len(tokens), chunk)]
    finally:
        program.release(seq)
    return torch.cat(rows).float().cpu()
