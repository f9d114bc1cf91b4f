"""DFlash and DFlash2 block-diffusion drafters for Qwen3.5 targets: config (:mod:`.config`), parameters
(:mod:`.parameters`), the converter's draft mapping (:mod:`.mapping`), weights (:mod:`.weights`), the drafter
(:mod:`.drafter`), drafting (:mod:`.propose`), sampled acceptance (:mod:`.sampling`) and the speculative step
(:mod:`.decoding`).

Backends: ``dflash`` runs a first-generation drafter (``DFlashDraftModel``), ``dflash2`` a second-generation one
(``DFlash2DraftModel``); both read the artifact's ``dflash`` component.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ninfer.errors import NotSupportedError

from ninfer_qwen3_5.config import Qwen35Config
from ninfer_qwen3_5.dflash.config import COMPONENT, DFlashConfig
from ninfer_qwen3_5.dflash.parameters import drafter_config

#: Backend name -> the drafter generation it runs.
DFLASH_BACKENDS = {"dflash": 1, "dflash2": 2}


def drafter_for_backend(text_config: Mapping[str, Any], backend: str) -> DFlashConfig:
    """The drafter config a text config carries, checked against the backend's generation (a clear error when
    the artifact's drafter is of the other one)."""
    cfg = drafter_config(text_config)
    want = DFLASH_BACKENDS[backend]
    if cfg.generation != want:
        other = next(name for name, gen in DFLASH_BACKENDS.items() if gen == cfg.generation)
        raise NotSupportedError(f"--speculative {backend} runs a {'DFlash2' if want == 2 else 'DFlash'} drafter, but "
                                f"this artifact's {COMPONENT!r} component is a {cfg.architecture} (use --speculative "
                                f"{other})")
    return cfg


def drafter_kv_layers(cfg: Qwen35Config, drafter: DFlashConfig) -> tuple[int, ...]:
    """The KV pool ids of the drafter's layers: ``num_layers + i`` (never a text layer's index)."""
    return tuple(cfg.num_layers + i for i in range(drafter.num_layers))


__all__ = ["DFLASH_BACKENDS", "drafter_for_backend", "drafter_kv_layers"]
