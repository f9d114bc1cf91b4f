"""A converted artifact's target model and DFlash drafter as plain objects, for comparisons against an oracle.

:func:`load_reference` opens an artifact that carries a ``dflash`` component and builds, on the CPU in fp32 with the
torch reference ops, the :class:`~ninfer_qwen3_5.model.Qwen35Model` and the
:class:`~ninfer_qwen3_5.dflash.drafter.DFlashDrafter` the engine would build from it (the drafter's KV pools are
the layer ids right after the target's). The engine itself goes through its Program; tests and the training tool's
parity check use this to call the drafter's math directly. It sits beside the ``dflash`` package, not in it: the model
imports that package (through its parameters), and this module imports the model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from ninfer.artifact import ArtifactReader, load_weights
from ninfer.contracts.features import StartupFeatures
from ninfer.ops import resolve_ops
from ninfer.plugins import get_registry

from ninfer_qwen3_5.config import Qwen35Config
from ninfer_qwen3_5.dflash.drafter import DFlashDrafter
from ninfer_qwen3_5.dflash.weights import load_dflash_weights
from ninfer_qwen3_5.model import Qwen35Model

CPU, F32 = torch.device("cpu"), torch.float32


def load_reference(entry: str | Path) -> tuple[Qwen35Config, object, Qwen35Model, DFlashDrafter]:
    """``(config, ops, model, drafter)`` of the artifact entry ``entry`` (fp32, CPU, reference ops)."""
    with ArtifactReader.open(entry) as reader:
        config = reader.component("text").config
        spec = get_registry().architecture(config["architectures"][0])
        weights = load_weights(reader, spec.parameter_specs(config, StartupFeatures()), "cpu")
        dcfg, dweights = load_dflash_weights(reader, "cpu")
    cfg = Qwen35Config.from_compact(config)
    ops = resolve_ops(get_registry().ops, "cpu", F32, force="reference")
    model = Qwen35Model(cfg, weights, ops, CPU, F32)
    layers = tuple(cfg.num_layers + i for i in range(dcfg.num_layers))
    return cfg, ops, model, DFlashDrafter(dcfg, dweights, model.embed, model.lm_head, ops, CPU, F32, layers)
