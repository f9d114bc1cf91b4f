"""What a speculative decoding backend registers (MTP, DFlash, DFlash2 come with their own issues)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SpeculativeBackendSpec:
    """``name`` is the startup option value (e.g. ``"mtp"``); ``architectures`` the target
    architectures it drafts for; ``create(program_init)`` builds the proposer the Program drives."""

    name: str
    architectures: tuple[str, ...]
    component: str
    create: Callable[[Any], Any]
