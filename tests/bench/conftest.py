"""``ninfer bench`` runs as a subprocess against the default model, converted once into a private cache."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def bench_env(default_model_cache):
    env = dict(os.environ, NINFER_CACHE_DIR=str(default_model_cache), PYTHONUNBUFFERED="1")
    env.pop("NINFER_VRAM_BUDGET_MIB", None)
    return env
