"""``ninfer bench`` runs as a subprocess against the default model, converted once into a private cache."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def bench_env(tmp_path_factory):
    from ninfer.model_source import resolve_model

    cache = tmp_path_factory.mktemp("ninfer-cache")
    old = os.environ.get("NINFER_CACHE_DIR")
    os.environ["NINFER_CACHE_DIR"] = str(cache)
    try:
        resolve_model(None)
    finally:
        if old is None:
            os.environ.pop("NINFER_CACHE_DIR")
        else:
            os.environ["NINFER_CACHE_DIR"] = old
    env = dict(os.environ, NINFER_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1")
    env.pop("NINFER_VRAM_BUDGET_MIB", None)
    return env
