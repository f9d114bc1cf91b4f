"""Fixtures of the converter tests: a registry with the synthetic architecture plugin injected."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The helper modules live beside this file; make them importable whatever pytest's import mode.
sys.path.insert(0, str(Path(__file__).parent))

import convert_synth_arch  # noqa: E402
from ninfer.plugins import PluginRegistry  # noqa: E402


@pytest.fixture(scope="session")
def registry() -> PluginRegistry:
    """Only core defaults plus ``SynthForCausalLM``: installed plugins cannot interfere."""
    return PluginRegistry(load_entry_points=False, extra_plugins=(convert_synth_arch,))
